"""The scheduler service: owns jobs, queues them (S1), admits them all-or-nothing (S4) with backfill,
grows elastic jobs (S10), expires jobs past their duration limit (J16) and explains itself (S6, `why`).

It answers the job commands and queries (commands.py, queries.py; every request authenticated, every
operation checked against J2), follows the monitor (nodes) and the launcher (process outcomes), and
runs scheduling cycles whenever something changed that could let a job start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import msgspec
from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.cluster import ClusterConfig, Flavor, Resources
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobRescaling,
    JobStopped,
    JobSucceeded,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeLost,
)
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import Prediction
from libs.eventstore import NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.scheduler.placement import NodeCapacity, QueuedJob, RunningJob, may_grow, schedule
from services.scheduler.prediction import predict
from services.scheduler.read_model import JobSearchProjection
from services.scheduler.state import SchedulerState

SERVICE = "scheduler"
SETTINGS_AGGREGATE = ("settings", "platform")
log = get_logger(__name__)
span_tracer = tracer("trainyard.scheduler")


def utc_now() -> datetime:
    return datetime.now(UTC)


class Scheduler:
    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig, *, cycle_seconds: float = 5.0,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self.rt = runtime
        self.secret = runtime.settings.require_auth_secret()
        self.state = SchedulerState(cluster)
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.cycle_seconds = cycle_seconds
        self.clock = clock
        self.followers: list[StreamFollower] = []
        self.search = JobSearchProjection(runtime.store)
        self._projection_wake = asyncio.Event()

    # --- start-up --------------------------------------------------------------------------------

    async def start(self) -> None:
        from services.scheduler.commands import register_commands
        from services.scheduler.queries import register_queries

        count = 0
        async for envelope in self.rt.store.read_all():
            self.state.apply(envelope)
            count += 1
        log.info("scheduler.rebuilt", events=count, jobs=len(self.state.jobs))
        await self.search.migrate()
        await self.search.catch_up()
        for upstream in ("monitor", "launcher"):
            follower = StreamFollower(self.rt.js, self.rt.store, stream=subjects.EVENTS_STREAM,
                                      subject=subjects.events_of_service(upstream),
                                      consumer=f"{upstream}-events", message_type=EventEnvelope,
                                      handle=self.on_upstream)
            await follower.start()
            self.followers.append(follower)
        register_commands(self)
        register_queries(self)
        self.rt.spawn(self.scheduling_loop(), "cycle")
        self.rt.spawn(self.projection_loop(), "search-projection")

    # --- appending -------------------------------------------------------------------------------

    async def append(self, changes: Sequence[tuple[str, Event]], tracking: Tracking | None = None) -> None:
        """Append job events (several jobs at once if need be) and fold them into the state."""
        expected = {("job", job_id): self.version(job_id) for job_id, _ in changes}
        stored = await self.rt.store.append(
            [NewEvent("job", job_id, event) for job_id, event in changes],
            expected_versions=expected, tracking=tracking, trace=current_trace_headers(),
        )
        self._applied(stored)

    async def append_settings(self, event: Event) -> None:
        stored = await self.rt.store.append([NewEvent(*SETTINGS_AGGREGATE, event)],
                                            expected_versions={SETTINGS_AGGREGATE: self.state.settings_version},
                                            trace=current_trace_headers())
        self._applied(stored)

    def _applied(self, stored: list[EventEnvelope]) -> None:
        for envelope in stored:
            self.state.apply(envelope)
            log.info("job.event", job_id=envelope.aggregate_id, event_type=type(envelope.event).name())
        self.wake.set()
        self._projection_wake.set()

    def version(self, job_id: str) -> int:
        job = self.state.jobs.get(job_id)
        return job.version if job else 0

    async def projection_loop(self) -> None:
        """Keep the search read model (O2) close behind the log; searches also catch up first."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._projection_wake.wait(), 5.0)
            self._projection_wake.clear()
            await self.search.catch_up()

    # --- following other services ------------------------------------------------------------------

    async def on_upstream(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        async with self.lock:
            self.state.apply(envelope)
            self.wake.set()
            if tracking is None:
                return False
            with span_tracer.start_as_current_span(
                f"scheduler react {type(envelope.event).name()}", context=context_from_headers(envelope.trace)
            ):
                changes = self.reactions(envelope)
                if not changes:
                    return False
                await self.append(changes, tracking)
                return True

    def reactions(self, envelope: EventEnvelope) -> list[tuple[str, Event]]:
        """What the scheduler records in answer to a launcher or monitor event."""
        event = envelope.event
        if isinstance(event, NodeLost):
            return [
                (job.job_id, JobFailed(job_id=job.job_id,
                                       reason=f"node {event.node_name} was lost: {event.reason}"))
                for job in self.state.jobs_on(event.node_name)
            ]
        if not isinstance(event, LaunchSucceeded | LaunchFailed | LaunchStopped):
            return []
        job = self.state.jobs.get(event.job_id)
        if job is None or job.status != "running" or job.attempt != event.attempt:
            return []
        if isinstance(event, LaunchSucceeded):
            return [(job.job_id, JobSucceeded(job_id=job.job_id))]
        if isinstance(event, LaunchFailed):
            return [(job.job_id, JobFailed(job_id=job.job_id, reason=event.reason, exit_code=event.exit_code))]
        if job.stop_requested_by is not None:
            return [(job.job_id, JobStopped(job_id=job.job_id, by=job.stop_requested_by))]
        if job.expiring:
            return [(job.job_id, JobExpired(job_id=job.job_id,
                                            reason=f"ran past its duration limit of {job.duration}"))]
        if job.rescaling is not None:
            # S10: the old attempt is down; the next one starts on the placement held for it.
            return [(job.job_id, JobAdmitted(job_id=job.job_id, attempt=job.attempt + 1,
                                             flavor=job.rescaling.flavor, placement=job.rescaling.placement,
                                             dropped_flavors=job.dropped_flavors))]
        return [(job.job_id, JobFailed(job_id=job.job_id, reason="its processes were stopped"))]

    # --- scheduling cycles -------------------------------------------------------------------------

    async def scheduling_loop(self) -> None:
        # Decide only on a complete view of nodes and launches.
        for follower in self.followers:
            await follower.caught_up.wait()
        log.info("scheduler.caught_up")
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self._seconds_to_next_deadline())
            self.wake.clear()
            async with self.lock:
                await self.run_cycle()

    def _seconds_to_next_deadline(self) -> float:
        """Sleep until the next cycle or the next duration limit, whichever comes first."""
        now = self.clock()
        deadlines = [(j.ends_at - now).total_seconds() for j in self.state.running()
                     if j.ends_at is not None and not j.expiring]
        return max(0.05, min([self.cycle_seconds, *deadlines]))

    def capacity(self) -> list[NodeCapacity]:
        used = self.state.used()
        return [
            NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
            for name, n in self.state.nodes.items() if not n.lost
        ]

    def flavors(self) -> dict[str, Flavor]:
        return {f.name: f for f in self.state.cluster.flavors}

    def queued_jobs(self) -> list[QueuedJob]:
        # The decision logic reads priority from the spec: give it the current one (S3).
        return [QueuedJob(j.job_id, j.spec if j.spec.priority == j.priority
                          else msgspec.structs.replace(j.spec, priority=j.priority), j.duration_seconds)
                for j in self.state.queue()]

    def running_jobs(self) -> list[RunningJob]:
        running: list[RunningJob] = []
        for job in self.state.running():
            flavor = self.state.flavor(job.flavor or "")
            if flavor is None:
                continue
            # A job being moved holds both placements until its next attempt starts.
            placement = list(job.placement) + (list(job.rescaling.placement) if job.rescaling else [])
            running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=placement,
                                      ends_at=job.ends_at,
                                      can_grow=job.rescaling is None and not job.expiring
                                      and job.stop_requested_by is None))
        return running

    def predict(self, spec: JobSpec) -> Prediction:
        """S6 for `spec` as if it were submitted now (the caller holds the lock)."""
        return predict(spec, self.queued_jobs(), self.capacity(), self.flavors(), running=self.running_jobs(),
                       now=self.clock(), duration_seconds=spec.max_duration_seconds)

    async def run_cycle(self) -> None:
        now = self.clock()
        await self._expire(now)
        queue = self.queued_jobs()
        running = self.running_jobs()
        if not queue and not any(map(may_grow, running)):
            return
        decision = schedule(queue, self.capacity(), self.flavors(), running=running, now=now)
        for admission in decision.admissions:
            job = self.state.jobs[admission.job_id]
            # Each admission continues the trace its job was submitted in.
            with span_tracer.start_as_current_span("scheduler admit", context=context_from_headers(job.trace)):
                await self.append([(job.job_id, JobAdmitted(
                    job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                    placement=admission.placement, dropped_flavors=admission.dropped_flavors,
                    backfilled=admission.backfilled))])
        for growth in decision.growths:
            job = self.state.jobs[growth.job_id]
            workers = sum(p.role == "worker" for p in job.placement)
            grown = sum(p.role == "worker" for p in growth.placement)
            with span_tracer.start_as_current_span("scheduler grow", context=context_from_headers(job.trace)):
                await self.append([(job.job_id, JobRescaling(
                    job_id=job.job_id, attempt=job.attempt, flavor=growth.flavor, placement=growth.placement,
                    reason=f"grows from {workers} to {grown} nodes now that resources are free"))])

    async def _expire(self, now: datetime) -> None:
        """J16: a running job past its duration limit is stopped and will end `expired`."""
        for job in self.state.running():
            if job.ends_at is not None and job.ends_at <= now and not job.expiring \
                    and job.stop_requested_by is None:
                with span_tracer.start_as_current_span("scheduler expire", context=context_from_headers(job.trace)):
                    await self.append([(job.job_id, JobExpiring(job_id=job.job_id, attempt=job.attempt,
                                                                limit_seconds=job.duration_seconds or 0))])
