"""Listings share the plans of their waiting jobs' starts: a client polling `list` never keeps the planning busy."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from types import SimpleNamespace
from typing import cast

import pytest
from nats.js.client import JetStreamContext

from libs.contracts.identity import Identity
from libs.contracts.operations.jobs import GetJob, ListJobs
from libs.contracts.scheduling import Prediction
from libs.eventstore import EventStore
from services.scheduler.handlers import queries as queries_module
from services.scheduler.handlers.queries import JobQueries
from services.scheduler.interfaces import Scheduling
from services.scheduler.planning.prediction import Forecast
from tests.support.scheduler_state import AT, Fold

ALICE = Identity(user="alice", projects=["default"])
FIRST, SECOND = "job-000000000001", "job-000000000002"


class Planner:
    """Plans that take as long as the test lets them."""

    def __init__(self) -> None:
        self.asked: list[set[str]] = []
        self.release = asyncio.Event()

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        self.asked.append(set(job_ids))
        await self.release.wait()
        return {job_id: Forecast(Prediction(starts_now=False, estimated_start=AT, predicted_at=AT))
                for job_id in job_ids}


def queries() -> tuple[JobQueries, Planner]:
    fold = Fold()
    for job_id in (FIRST, SECOND):
        fold.job(job_id, job_id, ["a100-1"])
    planner = Planner()
    scheduler = SimpleNamespace(state=fold.state, forecast_queued=planner.forecast_queued)
    return JobQueries(cast(Scheduling, scheduler), store=cast(EventStore, None),
                      js=cast(JetStreamContext, None)), planner


def expected(listed: object) -> dict[str, bool]:
    return {job.job_id: job.expected is not None for job in listed.jobs}  # type: ignore[attr-defined]


async def test_listings_of_the_same_jobs_share_one_plan_and_others_go_without_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]  # the listings' clock, moved by the test: how long a plan took is what it says
    monkeypatch.setattr(queries_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    views, planner = queries()
    newest = ListJobs(statuses=["queued"], limit=1)  # the newest: the second
    both = ListJobs(statuses=["queued"])
    polls = [asyncio.ensure_future(views.list_jobs(newest, ALICE)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert planner.asked == [{SECOND}]  # one plan for the three
    assert expected(await views.list_jobs(both, ALICE)) == {SECOND: False, FIRST: False}  # not planned, no new plan
    clock[0] += 1.0  # the plan takes a second
    planner.release.set()
    assert [expected(listed) for listed in await asyncio.gather(*polls)] == [{SECOND: True}] * 3
    # Rested four times as long as it planned (at most a fifth of the time)...
    assert views._listings.rest_until == pytest.approx(101.0 + 4 * 1.0)
    # ... and fresh for as long as it rests: answered from that plan, none started for others.
    clock[0] = 104.99
    assert expected(await views.list_jobs(newest, ALICE)) == {SECOND: True}
    assert expected(await views.list_jobs(both, ALICE)) == {SECOND: False, FIRST: False}
    assert planner.asked == [{SECOND}]
    # Once it rested, the next listing plans again.
    clock[0] = views._listings.rest_until
    assert expected(await views.list_jobs(both, ALICE)) == {SECOND: True, FIRST: True}
    assert planner.asked == [{SECOND}, {SECOND, FIRST}]


async def test_a_job_shown_has_its_own_plan_whatever_listings_do() -> None:
    views, planner = queries()
    polling = asyncio.ensure_future(views.list_jobs(ListJobs(statuses=["queued"], limit=1), ALICE))
    await asyncio.sleep(0.05)
    shown = asyncio.ensure_future(views.get_job(GetJob(job_id=FIRST), ALICE))
    await asyncio.sleep(0.05)
    assert planner.asked == [{SECOND}, {FIRST}]
    planner.release.set()
    details = await shown
    assert details.job.expected is not None  # type: ignore[union-attr]
    await polling
