"""The plans of waiting jobs' expected starts that the scheduler's queries start, shared between them, and the
forecasts the latest of them made, kept for the details of a job.

A plan plays the whole queue forward in the planning thread, one plan at a time: a second or more with a deep
queue, and it waits behind the predictions of new jobs and `predict`. Listings wait for one a moment (and share
it); the details of a job (`show`) wait for none: they tell what the latest plan expected, or what was predicted
when the job was queued, each with the moment it was made (`predicted_at`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from libs.contracts.scheduling import Prediction
from services.scheduler.domain.state import Job
from services.scheduler.planning.prediction import Forecast

LISTING_SHARE = 0.2  # of the time, at most, spent planning for listings and the details of jobs

Planner = Callable[[Collection[str]], Awaitable[dict[str, Forecast]]]


class SharedPlans:
    """The plans queries start, at most `LISTING_SHARE` of the time. A client polling `list` or `show` while a
    deep queue changes would otherwise keep a plan running at all times, each as costly as a prediction (a second
    or more on a small cluster with a deep queue), and the planning thread's hold on the interpreter slowed the
    whole scheduler (its CPU a trivial job went up seven times in `bench.throughput`). A listing of jobs the latest
    plan covers gets its answer, while it runs or, once done, until the next may start; others meanwhile go
    without. What each plan forecast is kept (`kept`) while its job waits, for the details of a job."""

    def __init__(self, plan: Planner, waiting: Callable[[str], bool]) -> None:
        self._plan, self._waiting = plan, waiting  # plans forecasts; whether a job still waits for its start
        self.latest: asyncio.Future[dict[str, Forecast]] | None = None
        self.jobs: frozenset[str] = frozenset()
        self.began = self.rest_until = 0.0
        self.kept: dict[str, Forecast] = {}

    def shared(self, job_ids: Collection[str]) -> asyncio.Future[dict[str, Forecast]] | None:
        """The latest plan, if it covers `job_ids` and is running or still fresh."""
        if self.latest is None or not self.jobs.issuperset(job_ids):
            return None
        return self.latest if self.resting() else None

    def resting(self) -> bool:
        """Whether a new plan must wait: one runs, or the last ended too recently."""
        return self.latest is not None and (not self.latest.done() or time.monotonic() < self.rest_until)

    def start(self, job_ids: Collection[str]) -> asyncio.Future[dict[str, Forecast]]:
        """A new plan of the forecasts of `job_ids` (the caller looked that none is `resting`)."""
        planned = asyncio.ensure_future(self._plan(job_ids))
        self.latest, self.jobs, self.began = planned, frozenset(job_ids), time.monotonic()
        planned.add_done_callback(functools.partial(self._ended, self.jobs, self.began))
        return planned

    def refresh(self, job_id: str) -> None:
        """Start a plan for `job_id` unless one runs or rests, not waited for: the next look at the job finds it
        kept. It plans the jobs of the latest plan too, so that listings polled meanwhile keep theirs."""
        if not self.resting():
            self.start([job_id, *(j for j in self.jobs if j != job_id and self._waiting(j))])

    def _ended(self, jobs: frozenset[str], began: float, planned: asyncio.Future[dict[str, Forecast]]) -> None:
        consumed(planned)
        ended = time.monotonic()
        self.rest_until = ended + (ended - began) * (1 - LISTING_SHARE) / LISTING_SHARE
        if not planned.cancelled() and planned.exception() is None:
            # Those planned have their forecast made afresh (none: no longer queued); the others keep theirs
            # while they wait.
            self.kept = {**{j: f for j, f in self.kept.items() if j not in jobs and self._waiting(j)},
                         **planned.result()}


def consumed(planned: asyncio.Future[Any]) -> None:
    """A plan no one waited for to its end: its failure is the planning thread's to log, not an unread one."""
    if not planned.cancelled():
        planned.exception()


def latest_expectation(job: Job, kept: Forecast | None) -> Prediction | None:
    """What the details of a waiting job tell of its start, without a plan of their own: the latest of the kept
    forecast (the latest plan the queries made for it) and the prediction recorded when it was queued. Either only
    if made while it waits now: one made before its first start is of an earlier wait."""
    made = [p for p in (kept.prediction if kept is not None else None, job.prediction)
            if p is not None and (job.started_at is None or p.predicted_at > job.started_at)]
    return max(made, key=lambda p: p.predicted_at, default=None)
