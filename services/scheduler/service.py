"""The scheduler service: owns jobs, queues them (S1), admits them all-or-nothing (S4) with backfill,
grows elastic jobs (S10), expires jobs past their duration limit (J16) and explains itself (S6, `why`).

It answers the job commands and queries (handlers/: every request authenticated, every operation
checked against J2), follows the monitor (nodes, pre-checks, slow jobs) and the launcher (process
outcomes) and answers them (rules/reactions.py), and runs scheduling cycles (rules/cycle.py) whenever
something changed that could let a job start. This module only wires those parts together and runs
its loops (cycles, predictions, the search read model, snapshots).

Checkpoint-resume jobs (J12) are pre-checked before they start (M1) and moved when a node of theirs is
lost, unhealthy or slow (M2, M6), up to their maximum resumes (M4); fault-restart jobs (J13) are
restarted on their nodes when their command fails, up to their maximum restarts (M5).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Self

from libs.contracts import subjects
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import EventEnvelope
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import Prediction
from libs.eventstore import NewEvent
from libs.eventstore.published import PublishedIndex
from libs.messaging.rpc import serve_operations
from libs.outages import OUTAGES
from libs.skeleton.eventsourced import (
    EventSourcedService,
    Loop,
    Pacer,
    Period,
    Restored,
    Upstream,
    aggregate_of,
    collector_paused,
)
from libs.skeleton.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.scheduler import metrics
from services.scheduler.domain.names import JOB, SERVICE, UPSTREAM_AGGREGATES, upstream_consumer
from services.scheduler.domain.state import SchedulerState
from services.scheduler.handlers.commands import JobCommands
from services.scheduler.handlers.image_commands import ImageCommands
from services.scheduler.handlers.logs import JobLogs
from services.scheduler.handlers.preloads import PreloadCommands
from services.scheduler.handlers.queries import JobQueries
from services.scheduler.handlers.whatif_queries import WhatIfQueries
from services.scheduler.history import past, snapshot_process, start_snapshots
from services.scheduler.history.archived import Archive
from services.scheduler.history.past import PastStates
from services.scheduler.planning.decision_inputs import plan_inputs
from services.scheduler.planning.prediction import Forecast
from services.scheduler.planning.prediction_cache import PlanInputs, PredictionCache
from services.scheduler.planning.thread import PlanningThread
from services.scheduler.read_model import JobSearchProjection
from services.scheduler.rules import archive, cycle, predicted
from services.scheduler.rules.reactions import react
from services.scheduler.rules.submissions import SubmissionBatches

log = get_logger(__name__)
span_tracer = tracer(f"trainyard.{SERVICE}")
# The share of the scheduler's time the predictions of new jobs may take while jobs keep coming: a plan of a
# deep queue takes a while, and the cycles and the submissions come first.
PREDICTION_SHARE = 0.25
# And they are planned at most this often: a plan costs the whole queue ahead of the new jobs, so under a flood
# of submissions one plan for many new jobs beats a plan for a few, each a moment sooner.
PREDICTION_PERIOD = 0.5
# The share of its time the scheduler's cycles may take (libs/skeleton/eventsourced.py `Pacer`), and after a cycle that
# started nothing.
CYCLE_SHARE, IDLE_CYCLE_SHARE = 0.5, 0.2
# Cycles begin at most this often (libs/skeleton/eventsourced.py `Period`), each deciding on all that came meanwhile: a
# cycle costs its look at the state and its appends whatever it decides.
CYCLE_PERIOD = 0.1
# The search read model catches up at most this often while events keep coming, each time with all that came
# meanwhile (a search catches up first, so it finds what was just recorded all the same).
PROJECTION_PERIOD = 0.5
# Ended jobs past their retention are looked for this often (a minute's lateness is nothing against a retention).
ARCHIVE_PERIOD = 10.0


def utc_now() -> datetime:
    return datetime.now(UTC)


class Scheduler(EventSourcedService):
    name = SERVICE

    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig, *, cycle_seconds: float = 5.0,
                 clock: Callable[[], datetime] = utc_now) -> None:
        super().__init__(runtime)
        self.secret = runtime.settings.require_auth_secret()
        self.state = SchedulerState(cluster)
        self.cycle_seconds = cycle_seconds
        self.clock = clock
        self.settle = cycle.settle_time(runtime.settings)
        self.search = JobSearchProjection(runtime.store)
        # Where the other services' events about archived jobs are (their histories), beside the log.
        self.published = PublishedIndex(runtime.store)
        self._search_wake = asyncio.Event()
        self.predictions = PredictionCache()  # S6: the plan of the queue, kept until the state changes
        self.planning = PlanningThread(self.predictions)
        self.submissions = SubmissionBatches(self.state, self.lock, self.record)  # group commit
        self._predict_wake = asyncio.Event()  # set after a cycle that left jobs without a prediction
        self.cycle_saw = 0  # the log position of the newest submission the last cycle saw (predicted.py)
        self.pacer = Pacer(share=CYCLE_SHARE)
        self._changed = asyncio.Event()  # set by every event that changes what a cycle decides on
        self.past: PastStates | None = None  # the states of past instants (`trainyard at`), once it answers

    @classmethod
    def create(cls, runtime: ServiceRuntime) -> Self:
        return cls(runtime, ClusterConfig.load(runtime.settings.cluster_config))

    # --- state -------------------------------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        """Fold an event (its own, or a followed one) into the state; the prediction cache learns what
        changed (and how long jobs ran)."""
        revision = self.state.revision
        self.state.apply(envelope)
        for aggregate_type, aggregate_id in self.state.take_left():  # archived: its version goes with it
            self.forget(aggregate_type, aggregate_id)
        self.predictions.applied(envelope, self.state.jobs)
        if self.state.revision != revision:
            self._changed.set()

    def fold_stored(self, envelope: EventEnvelope, sequence: int) -> None:
        """Fold another service's event, noting where it is stored when it is about a job (its history)."""
        self.fold(envelope)
        self.state.stored_at(envelope, sequence)

    def recorded(self, envelope: EventEnvelope) -> None:
        log.info("job.event", job_id=envelope.aggregate_id, event_type=type(envelope.event).name())
        self._search_wake.set()
        metrics.count(envelope, self.state)

    def sample_metrics(self) -> None:
        metrics.sample(self.state)

    async def prepare(self) -> None:
        await self.published.migrate()
        await self.search.migrate()
        await self.search.catch_up()

    # --- rules: what it records in answer to the monitor and the launcher -----------------------------

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of(upstream, *aggregates),
                         consumer=upstream_consumer(upstream), message_type=EventEnvelope, fold_at=self.fold_stored,
                         react=self.react, key=aggregate_of if upstream == "launcher" else None)
                for upstream, aggregates in UPSTREAM_AGGREGATES.items()]

    def react(self, envelope: EventEnvelope) -> list[NewEvent]:
        return react(self.state, envelope)

    # --- handlers ----------------------------------------------------------------------------------

    def handlers(self) -> None:
        archive = Archive(self.rt.store, self.rt.js, self.published, lambda: self.state)
        commands = JobCommands(self, storage_root=self.rt.settings.storage_root, archive=archive)
        self.past = PastStates(self.rt.store, self.rt.js, lambda: self.state.cluster)
        queries = JobQueries(self, store=self.rt.store, js=self.rt.js, past=self.past, archive=archive)
        logs = JobLogs(self, nc=self.rt.nc, js=self.rt.js, archive=archive)
        preloads = PreloadCommands(self, storage_root=self.rt.settings.storage_root)
        whatif = WhatIfQueries(self, queries.past)
        images = ImageCommands(self, storage_root=self.rt.settings.storage_root)
        serve_operations(self.rt.broker, self.name, [*commands.routes(), *queries.routes(), *logs.routes(),
                                                     *preloads.routes(), *whatif.routes(), *images.routes()],
                         secret=self.secret)

    async def predict(self, spec: JobSpec) -> Prediction:
        """S6 for `spec` as if it were submitted now. Planned in a worker thread, without the lock: the
        loop goes on meanwhile (cycles, commands, events); the plan reads copies of the state taken
        when its turn comes."""
        forecast = await self.planning.forecast(spec, clock=self.clock, inputs=self._plan_inputs,
                                                duration_seconds=spec.max_duration_seconds)
        return forecast.prediction

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        """S6 for jobs already queued, as their predictions are made (in the worker thread, without the lock)."""
        return await self.planning.forecast_queued(job_ids, clock=self.clock, inputs=self._plan_inputs)

    def _plan_inputs(self) -> PlanInputs:
        return plan_inputs(self.state, self.clock())

    # --- loops -------------------------------------------------------------------------------------

    def loops(self) -> Mapping[str, Loop]:
        return {"cycle": self.scheduling_loop, "search-projection": self.projection_loop,
                "predictions": self.prediction_loop, "snapshots": self.snapshot_loop, "archive": self.archive_loop}

    async def scheduling_loop(self) -> None:
        await self.caught_up()  # decide only on a complete view of nodes and launches
        log.info("scheduler.caught_up")
        period = Period(CYCLE_PERIOD)
        while True:
            # Woken by what changes a decision (not by news of processes or predictions), by a deadline, or at the
            # latest after `cycle_seconds`, as time itself changes reservations.
            wait = cycle.seconds_to_wait(self.state, self.clock(), cycle_seconds=self.cycle_seconds,
                                         settle=self.settle)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
            await self.pacer.turn()  # what came meanwhile is folded first, and decided on in one cycle
            await period.turn()
            async with self.lock:
                began = time.perf_counter()
                with self.pacer.run():
                    decided = await self.run_cycle()
                metrics.cycle_durations.record(time.perf_counter() - began)
                # It decided on everything folded so far, and what it recorded itself leaves nothing more to decide
                # (nothing else is folded while the lock is held).
                self._changed.clear()
            # A cycle that started nothing found the cluster full or the queue stuck: the next waits longer, so a
            # flood of submissions is taken in rather than decided on again after each.
            self.pacer.share = CYCLE_SHARE if decided else IDLE_CYCLE_SHARE

    async def run_cycle(self) -> bool:
        """Expire, fail what settled, then admit and grow; each recorded in a span continuing its job's trace.
        Whether it recorded anything."""
        saw = predicted.newest_waiting(self.state)
        try:
            return await self._decide_cycle()
        finally:  # what it left queued without a prediction has one planned now (predicted.py)
            self.cycle_saw = max(self.cycle_saw, saw)
            if predicted.left_waiting(self.state, self.cycle_saw):
                self._predict_wake.set()

    async def _decide_cycle(self) -> bool:
        now = self.clock()
        expired = await self._record_each("expire", cycle.expirations(self.state, now))
        failed = await self._record_each("fail", cycle.settled_failures(self.state, now, self.settle))
        # A decision makes many short-lived objects over a large state: the cycle collector, which would scan the whole
        # state in the middle of it (at 10,000 nodes its passes made most of a busy cycle's p95), runs after it.
        with collector_paused():
            decision = cycle.decide(self.state, now)
        if decision is None:
            return expired or failed
        admitted = await self._record_each("admit", cycle.admissions(self.state, decision, now))
        grown = await self._record_each("grow", cycle.growths(self.state, decision))
        return expired or failed or admitted or grown

    async def _record_each(self, what: str, changes: list[NewEvent]) -> bool:
        """Record a cycle's decisions of one kind in one append, each in a span continuing its job's trace."""
        traced = []
        for change in changes:
            trace = self.state.jobs[change.aggregate_id].trace
            with span_tracer.start_as_current_span(f"scheduler {what}", context=context_from_headers(trace),
                                                   attributes={"trainyard.job.id": change.aggregate_id}):
                traced.append(NewEvent(change.aggregate_type, change.aggregate_id, change.event,
                                       trace=current_trace_headers()))
        await self.record(traced)
        return bool(traced)

    async def snapshot_loop(self) -> None:
        """Snapshots of past states made ahead, by the active scheduler only: before any view asks for one (past.py),
        and for its next start (start_snapshots.py)."""
        await self.caught_up()
        while True:
            await asyncio.sleep(past.KEEP_AHEAD_SECONDS)
            if self.past is None:
                continue
            try:
                if await self.past.snapshot_due():
                    await snapshot_process.made_apart(self.clock(), self.state.cluster, self.rt.settings)
            except OUTAGES:
                raise  # the loop pauses until they are back
            except Exception:  # snapshots only save time: the service goes on without a new one
                log.exception("scheduler.snapshot_failed")

    async def archive_loop(self) -> None:
        """Ended jobs leave the state once their retention is over (rules/archive.py), a batch an append, so that
        cycles and commands go on between the appends of a long backlog."""
        await self.caught_up()  # a kept debug environment, which holds a job, comes from the monitor
        while True:
            async with self.lock:
                changes = archive.archivals(self.state, self.clock())
                for change in changes:  # where their other events are, written first: done twice, no matter
                    if (job := self.state.jobs.get(change.aggregate_id)) is not None and change.aggregate_type == JOB:
                        self.published.note(job.job_id, job.published)
                await self.published.write()
                await self.record(changes)
            if len(changes) < archive.ARCHIVE_BATCH:
                await asyncio.sleep(ARCHIVE_PERIOD)

    async def restore(self) -> Restored:
        """The state of the latest snapshot a start may take (start_snapshots.py), and where it stands."""
        found = await start_snapshots.restored(self.rt.store, self.rt.js, self.state.cluster)
        if found is None:
            return Restored()
        self.state, self.predictions, self.versions, restored = found
        self.planning = PlanningThread(self.predictions)
        self.submissions = SubmissionBatches(self.state, self.lock, self.record)
        log.info("scheduler.restored", own_after=restored.own_after, events=restored.events,
                 upstream_after=dict(restored.upstream_after))
        return restored

    async def prediction_loop(self) -> None:
        """S6 for the jobs submitted without asking for one: planned together, off the event loop and
        without the lock, and recorded in one append (predicted.py)."""
        await self.caught_up()
        pacer, period = Pacer(share=PREDICTION_SHARE), Period(PREDICTION_PERIOD)
        while True:
            await self._predict_wake.wait()
            await pacer.turn()  # a deep queue's plan takes a while: the jobs submitted meanwhile join the next
            await period.turn()
            self._predict_wake.clear()
            if not self.state.unpredicted:
                continue
            with pacer.run():
                queued = predicted.to_plan(self.state, self.cycle_saw)
                forecasts = await self.forecast_queued(queued) if queued else {}
                async with self.lock:
                    await self.record(predicted.predictions(self.state, forecasts))
            if predicted.to_plan(self.state, self.cycle_saw):  # more were left waiting meanwhile, or a batch's worth
                self._predict_wake.set()

    async def projection_loop(self) -> None:
        """Keep the search read model (O2) close behind the log; searches also catch up first."""
        period = Period(PROJECTION_PERIOD)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._search_wake.wait(), 5.0)
            await period.turn()
            self._search_wake.clear()
            await self.search.catch_up()
