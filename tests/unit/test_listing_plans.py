"""Listings and the details of jobs share the plans of their waiting jobs' starts: a client polling `list` or `show`
never keeps the planning busy, and `show` never waits for a plan."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import cast

import pytest
from nats.js.client import JetStreamContext

from libs.contracts.events import JobAdmitted, JobPredicted, JobRequeued, Placement
from libs.contracts.identity import Identity
from libs.contracts.operations.jobs import GetJob, JobDetails, ListJobs
from libs.contracts.scheduling import Prediction
from libs.eventstore import EventStore
from services.scheduler.handlers import shared_plans
from services.scheduler.handlers.queries import JobQueries, StateQueries
from services.scheduler.handlers.shared_plans import latest_expectation
from services.scheduler.interfaces import Scheduling
from services.scheduler.planning.prediction import Forecast
from tests.support.scheduler_state import AT, Fold

ALICE = Identity(user="alice", projects=["default"])
FIRST, SECOND = "job-000000000001", "job-000000000002"


class Planner:
    """Plans that take as long as the test lets them."""

    def __init__(self, at: datetime = AT) -> None:
        self.asked: list[set[str]] = []
        self.release = asyncio.Event()
        self.at = at  # when its plans are made

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        self.asked.append(set(job_ids))
        await self.release.wait()
        return {job_id: Forecast(prediction(self.at)) for job_id in job_ids}


def prediction(at: datetime) -> Prediction:
    return Prediction(starts_now=False, estimated_start=at + timedelta(hours=1), predicted_at=at)


def queries(fold: Fold | None = None, planner: Planner | None = None) -> tuple[JobQueries, Planner]:
    if fold is None:
        fold = Fold()
        for job_id in (FIRST, SECOND):
            fold.job(job_id, job_id, ["a100-1"])
    planner = planner or Planner()
    scheduler = SimpleNamespace(state=fold.state, forecast_queued=planner.forecast_queued)
    return JobQueries(cast(Scheduling, scheduler), store=cast(EventStore, None),
                      js=cast(JetStreamContext, None)), planner


def expected(listed: object) -> dict[str, bool]:
    return {job.job_id: job.expected is not None for job in listed.jobs}  # type: ignore[attr-defined]


async def test_listings_of_the_same_jobs_share_one_plan_and_others_go_without_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]  # the listings' clock, moved by the test: how long a plan took is what it says
    monkeypatch.setattr(shared_plans, "time", SimpleNamespace(monotonic=lambda: clock[0]))
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
    assert views._plans.rest_until == pytest.approx(101.0 + 4 * 1.0)
    # ... and fresh for as long as it rests: answered from that plan, none started for others.
    clock[0] = 104.99
    assert expected(await views.list_jobs(newest, ALICE)) == {SECOND: True}
    assert expected(await views.list_jobs(both, ALICE)) == {SECOND: False, FIRST: False}
    assert planner.asked == [{SECOND}]
    # Once it rested, the next listing plans again.
    clock[0] = views._plans.rest_until
    assert expected(await views.list_jobs(both, ALICE)) == {SECOND: True, FIRST: True}
    assert planner.asked == [{SECOND}, {SECOND, FIRST}]


async def test_a_waiting_job_is_shown_at_once_and_its_next_look_finds_the_plan_it_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(shared_plans, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    views, planner = queries()
    newest = ListJobs(statuses=["queued"], limit=1)
    polling = asyncio.ensure_future(views.list_jobs(newest, ALICE))
    await asyncio.sleep(0.05)
    # A plan runs (the listing's, or any a new one would wait behind): shown at once, without it, none started.
    shown = await asyncio.wait_for(views.get_job(GetJob(job_id=FIRST), ALICE), 5)
    assert isinstance(shown, JobDetails) and shown.job.expected is None
    assert planner.asked == [{SECOND}]
    clock[0] = 101.0
    planner.release.set()
    assert expected(await polling) == {SECOND: True}
    # Once it rested, a look starts a plan for the job and the listing's jobs, and is answered without it...
    clock[0] = 105.0
    planner.release.clear()
    shown = await asyncio.wait_for(views.get_job(GetJob(job_id=FIRST), ALICE), 5)
    assert isinstance(shown, JobDetails) and shown.job.expected is None
    await asyncio.sleep(0.05)
    assert planner.asked == [{SECOND}, {FIRST, SECOND}]
    clock[0] = 106.0
    planner.release.set()
    await asyncio.sleep(0.05)
    # ... which the next look tells, as the listing polled meanwhile does, while it rests.
    shown = await views.get_job(GetJob(job_id=FIRST), ALICE)
    assert isinstance(shown, JobDetails) and shown.job.expected == prediction(AT)
    assert expected(await views.list_jobs(newest, ALICE)) == {SECOND: True}
    assert len(planner.asked) == 2


async def test_a_shown_job_tells_the_prediction_recorded_when_queued_until_a_later_plan() -> None:
    fold = Fold()
    fold.job(FIRST, "first", ["a100-1"])
    recorded = prediction(AT + timedelta(minutes=1))
    fold.apply(JobPredicted(job_id=FIRST, prediction=recorded))
    views, planner = queries(fold, Planner(AT + timedelta(minutes=2)))
    shown = await asyncio.wait_for(views.get_job(GetJob(job_id=FIRST), ALICE), 5)
    assert isinstance(shown, JobDetails) and shown.job.expected == recorded  # a plan is held
    planner.release.set()
    await asyncio.sleep(0.05)
    shown = await views.get_job(GetJob(job_id=FIRST), ALICE)
    assert isinstance(shown, JobDetails) and shown.job.expected == prediction(AT + timedelta(minutes=2))


async def test_a_past_states_job_is_shown_with_a_plan_of_its_own() -> None:
    fold = Fold()
    fold.job(FIRST, "first", ["a100-1"])
    planner = Planner()
    planner.release.set()
    past = SimpleNamespace(state=fold.state, forecast_queued=planner.forecast_queued)
    shown = await StateQueries(cast(Scheduling, past)).get_job(GetJob(job_id=FIRST), ALICE)
    assert isinstance(shown, JobDetails) and shown.job.expected == prediction(AT)
    assert planner.asked == [{FIRST}]


def test_the_latest_prediction_made_while_the_job_waits_now_is_told() -> None:
    fold = Fold()
    fold.job(FIRST, "first", ["a100-1"])
    job = fold.state.jobs[FIRST]
    early, late = prediction(AT - timedelta(minutes=5)), prediction(AT + timedelta(minutes=5))
    assert latest_expectation(job, None) is None
    fold.apply(JobPredicted(job_id=FIRST, prediction=early))
    assert latest_expectation(job, None) == early
    assert latest_expectation(job, Forecast(late)) == late
    fold.apply(JobPredicted(job_id=FIRST, prediction=late))
    assert latest_expectation(job, Forecast(early)) == late
    # Back in the queue after it ran (started at AT): what was predicted before its start is of its first wait.
    fold.apply(JobAdmitted(job_id=FIRST, attempt=1, flavor="a100-1",
                           placement=[Placement(rank=0, node="n1", address="n1", slots=1)]))
    fold.apply(JobRequeued(job_id=FIRST, attempt=1, reason="node lost", resumes=1))
    assert job.status == "queued" and job.started_at == AT
    assert latest_expectation(job, Forecast(early)) == late
    fold.apply(JobPredicted(job_id=FIRST, prediction=early))
    assert latest_expectation(job, Forecast(early)) is None
