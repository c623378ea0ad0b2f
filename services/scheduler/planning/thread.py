"""Predictions planned in a worker thread, one at a time, while the scheduler's event loop goes on.

Planning a deep queue takes seconds. The prediction cache makes a prediction in three steps
(`begin`, `plan`, `end`); here `begin` and `end` run on the event loop and `plan` in a worker thread,
so cycles, commands and events go on meanwhile. The loop calls `inputs()` (copies nothing mutates)
when a plan is made afresh, and the cache only notes the events folded while the thread plans. The cycle
collector is paused while a plan is made (a third of a cold plan's time at 10,000 jobs on 1,000 nodes).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable, Collection
from datetime import datetime
from typing import TypeVar

from libs.contracts.jobspec import JobSpec
from libs.skeleton.eventsourced import collector_paused
from services.scheduler.metrics import prediction_durations
from services.scheduler.planning.prediction import Forecast
from services.scheduler.planning.prediction_cache import PlanInputs, PredictionCache

T = TypeVar("T")


class PlanningThread:
    """Plans the predictions of one `PredictionCache` in worker threads, one after another."""

    def __init__(self, cache: PredictionCache) -> None:
        self.cache = cache
        self._turn = asyncio.Lock()  # held from `begin` until the cache is back from the thread

    async def forecast(self, spec: JobSpec, *, clock: Callable[[], datetime], inputs: Callable[[], PlanInputs],
                       duration_seconds: int | None = None) -> Forecast:
        """The cache's `forecast`, planned in a worker thread. `clock()` gives the moment of a new
        plan, read when this prediction's turn comes."""
        seconds = spec.max_duration_seconds if duration_seconds is None else duration_seconds
        afresh = False
        while True:
            await self._turn.acquire()
            try:
                ticket = self.cache.begin(clock(), inputs, afresh=afresh)
            except BaseException:
                self._turn.release()
                raise
            planned = self._in_thread(functools.partial(self.cache.plan, ticket, spec, seconds))
            # Shielded: a cancelled caller leaves the thread to finish, and the cache comes back then.
            answer = await asyncio.shield(planned)
            if answer is not None:
                return answer
            afresh = True  # a job taken in changes everything behind it: plan the state as it is now

    async def forecast_queued(self, job_ids: Collection[str], *, clock: Callable[[], datetime],
                              inputs: Callable[[], PlanInputs]) -> dict[str, Forecast]:
        """The forecasts of jobs already queued, planned together in a worker thread on the state as it is when
        their turn comes (`inputs()` at `clock()`); those no longer queued then get none."""
        await self._turn.acquire()
        try:
            self.cache.begin_queued()
        except BaseException:
            self._turn.release()
            raise
        try:
            plan = functools.partial(self.cache.plan_queued, inputs(), clock(), job_ids)
        except BaseException:
            self._returned(failed=True)
            raise
        return await asyncio.shield(self._in_thread(plan))

    def _in_thread(self, plan: Callable[[], T]) -> asyncio.Future[T]:
        """Run `plan` in a worker thread; once it is done, the cache's plan ends (on the loop) and the
        next prediction may begin."""
        loop = asyncio.get_running_loop()
        try:
            planned = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, _paused, plan))
        except BaseException:
            self._returned(failed=True)
            raise

        def returned(future: asyncio.Future[T]) -> None:
            self._returned(failed=future.cancelled() or future.exception() is not None)

        planned.add_done_callback(returned)
        return planned

    def _returned(self, *, failed: bool) -> None:
        self.cache.end(failed=failed)
        self._turn.release()


def _paused(plan: Callable[[], T]) -> T:
    """`plan` with Python's cycle collector paused: a plan makes many objects that live on (its kept cycles and
    copies) and little cyclic garbage, and the collector would scan the whole state again and again meanwhile."""
    began = time.perf_counter()
    with collector_paused():
        planned = plan()
    prediction_durations.record(time.perf_counter() - began)
    return planned
