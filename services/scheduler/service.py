"""The scheduler service: owns jobs, queues them (S1), admits them all-or-nothing (S4) with backfill,
grows elastic jobs (S10), expires jobs past their duration limit (J16) and explains itself (S6, `why`).

It answers the job commands and queries (commands.py, queries.py; every request authenticated, every
operation checked against J2), follows the monitor (nodes, pre-checks, slow jobs) and the launcher
(process outcomes), and runs scheduling cycles whenever something changed that could let a job start.

Checkpoint-resume jobs (J12) are pre-checked before they start (M1) and moved when a node of theirs is
lost, unhealthy or slow (M2, M6), up to their maximum resumes (M4); fault-restart jobs (J13) are
restarted on their nodes when their command fails, up to their maximum restarts (M5).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

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
    JobPrecheckFailed,
    JobPrechecking,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobSucceeded,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeLost,
    NodeUnhealthy,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
)
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import Prediction
from libs.eventstore import NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.scheduler.placement import Admission, NodeCapacity, QueuedJob, RunningJob, may_grow, schedule
from services.scheduler.prediction_cache import JobFacts, PlanInputs, PredictionCache
from services.scheduler.read_model import JobSearchProjection
from services.scheduler.state import Job, SchedulerState

SERVICE = "scheduler"
# M1: nodes that failed a job's pre-check are not tried for it again until this long after.
RECHECK_AFTER = timedelta(seconds=60)
SETTINGS_AGGREGATE = ("settings", "platform")
STORAGE_AGGREGATE = ("storage", "catalog")  # J2: registrations of shared storage's resources
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
        self.predictions = PredictionCache()  # S6: the plan of the queue, kept until the state changes
        # Submissions are predicted and recorded one at a time, so each prediction counts the jobs
        # submitted before it.
        self.submitting = asyncio.Lock()

    # --- start-up --------------------------------------------------------------------------------

    async def start(self) -> None:
        from services.scheduler.commands import register_commands
        from services.scheduler.queries import register_queries

        count = 0
        async for envelope in self.rt.store.read_all():
            self.fold(envelope)
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
        await self._append_to(SETTINGS_AGGREGATE, self.state.settings_version, event)

    async def append_storage_access(self, event: Event) -> None:
        await self._append_to(STORAGE_AGGREGATE, self.state.storage_version, event)

    async def _append_to(self, aggregate: tuple[str, str], version: int, event: Event) -> None:
        """Append to one of the scheduler's single-instance aggregates, at the version folded so far."""
        stored = await self.rt.store.append([NewEvent(*aggregate, event)], expected_versions={aggregate: version},
                                            trace=current_trace_headers())
        self._applied(stored)

    def _applied(self, stored: list[EventEnvelope]) -> None:
        for envelope in stored:
            self.fold(envelope)
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
            self.fold(envelope)
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
        return react(self.state, envelope)

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
        """Sleep until the next cycle, duration limit or settled failure, whichever comes first."""
        now = self.clock()
        deadlines = [(j.ends_at - now).total_seconds() for j in self.state.running()
                     if j.ends_at is not None and not j.expiring]
        deadlines += [(j.unexplained_failure[1] + self.settle - now).total_seconds() for j in self.state.running()
                      if j.unexplained_failure is not None]
        return max(0.05, min([self.cycle_seconds, *deadlines]))

    @property
    def settle(self) -> timedelta:
        """How long a checkpoint-resume job's failure waits for a node fault to explain it: long enough
        for a dead node to be declared lost."""
        settings = self.rt.settings
        return timedelta(seconds=settings.node_lost_seconds + 4 * settings.heartbeat_seconds)

    def capacity(self) -> list[NodeCapacity]:
        return node_capacity(self.state)

    def flavors(self) -> dict[str, Flavor]:
        return cluster_flavors(self.state)

    def queued_jobs(self) -> list[QueuedJob]:
        return queued_jobs(self.state, self.clock())

    def running_jobs(self) -> list[RunningJob]:
        return running_jobs(self.state, self.clock())

    async def predict(self, spec: JobSpec) -> Prediction:
        """S6 for `spec` as if it were submitted now. Planned in a worker thread, without the lock: the
        loop goes on meanwhile (cycles, commands, events); the plan reads copies of the state taken
        when its turn comes."""
        forecast = await self.predictions.forecast_in_thread(
            spec, clock=self.clock, inputs=self.prediction_inputs, duration_seconds=spec.max_duration_seconds)
        return forecast.prediction

    def prediction_inputs(self) -> PlanInputs:
        return plan_inputs(self.state, self.clock())

    def fold(self, envelope: EventEnvelope) -> None:
        """Fold an event into the state; the prediction cache learns what changed (and how long jobs ran)."""
        self.state.apply(envelope)
        self.predictions.applied(envelope, self.state.jobs)

    async def run_cycle(self) -> None:
        now = self.clock()
        await self._expire(now)
        await self._settle_failures(now)
        queue = self.queued_jobs()
        running = self.running_jobs()
        if not queue and not any(map(may_grow, running)):
            return
        decision = schedule(queue, self.capacity(), self.flavors(), running=running, now=now)
        for admission in decision.admissions:
            job = self.state.jobs[admission.job_id]
            # Each admission continues the trace its job was submitted in.
            with span_tracer.start_as_current_span("scheduler admit", context=context_from_headers(job.trace)):
                await self.append([(job.job_id, admission_event(job, admission))])
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


    async def _settle_failures(self, now: datetime) -> None:
        """J12: a checkpoint-resume job that failed with no node fault reported within the settle
        time failed on its own."""
        for job in self.state.running():
            if job.unexplained_failure is None or job.moving:
                continue
            failure, failed_at = job.unexplained_failure
            if failed_at + self.settle <= now:
                with span_tracer.start_as_current_span("scheduler fail", context=context_from_headers(job.trace)):
                    await self.append([(job.job_id, JobFailed(job_id=job.job_id, reason=failure.reason,
                                                              exit_code=failure.exit_code))])


# --- what the decision logic sees of the state ----------------------------------------------------------------


def node_capacity(state: SchedulerState) -> list[NodeCapacity]:
    """The schedulable nodes and what is free on each."""
    used = state.used()
    return [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
            for name, n in state.nodes.items() if n.schedulable]


def cluster_flavors(state: SchedulerState) -> dict[str, Flavor]:
    return {f.name: f for f in state.cluster.flavors}


def queued_jobs(state: SchedulerState, now: datetime) -> list[QueuedJob]:
    # The decision logic reads priority from the spec: give it the current one (S3).
    return [QueuedJob(j.job_id, j.spec if j.spec.priority == j.priority
                      else msgspec.structs.replace(j.spec, priority=j.priority), j.duration_seconds,
                      state.avoided_nodes(j, now, RECHECK_AFTER))
            for j in state.queue()]


def running_jobs(state: SchedulerState, now: datetime) -> list[RunningJob]:
    """Jobs that hold resources, as the decision logic sees them: running ones, and those being
    pre-checked (they hold their placement and, once admitted, run until their limit)."""
    running: list[RunningJob] = []
    for job in state.holding():
        held = state.placements(job)
        flavor = state.flavor(held[0][0]) if held else None
        if flavor is None:
            continue
        # A job being moved holds both placements until its next attempt starts.
        placement = [p for _, placement in held for p in placement]
        ends_at = job.ends_at
        if job.prechecking and job.duration_seconds is not None:  # as if it started now
            ends_at = now + timedelta(seconds=job.duration_seconds) - job.ran_before
        running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=placement,
                                  ends_at=ends_at, can_grow=job.status == "running" and not job.moving,
                                  excluded_nodes=frozenset(job.excluded_nodes)))
    return running


def plan_inputs(state: SchedulerState, now: datetime) -> PlanInputs:
    """What a prediction plans from, copied: the plan runs in a worker thread while the event loop
    changes the state."""
    queue, running = queued_jobs(state, now), running_jobs(state, now)
    jobs = state.jobs
    facts = {held.job_id: JobFacts.of(jobs[held.job_id]) for held in running}
    for queued in queue:  # its limit is parsed already
        job = jobs[queued.job_id]
        facts[job.job_id] = JobFacts(job.spec, job.creator, job.flavor, job.started_at, job.ended_at,
                                     queued.duration_seconds)
    return PlanInputs(queue=queue, nodes=node_capacity(state), flavors=cluster_flavors(state), running=running,
                      jobs=facts)


# --- decisions on one job (pure: the state in, the events to record out) -----------------------------------


def admission_event(job: Job, admission: Admission) -> Event:
    """A placed job starts, unless it resumes from checkpoints (J12): its nodes are pre-checked first (M1)."""
    if job.spec.checkpoint_resume is not None:
        return JobPrechecking(job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                              placement=admission.placement, dropped_flavors=admission.dropped_flavors)
    return JobAdmitted(job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                       placement=admission.placement, dropped_flavors=admission.dropped_flavors,
                       backfilled=admission.backfilled)


def react(state: SchedulerState, envelope: EventEnvelope) -> list[tuple[str, Event]]:
    """What the scheduler records in answer to a launcher or monitor event (folded into `state` already)."""
    event = envelope.event
    if isinstance(event, NodeLost | NodeUnhealthy):
        return _node_fault(state, event)
    if isinstance(event, PrecheckCompleted):
        return _precheck_result(state, event)
    if isinstance(event, PerformanceDegraded):
        return _slow_node(state, event)
    if not isinstance(event, LaunchSucceeded | LaunchFailed | LaunchStopped):
        return []
    job = state.jobs.get(event.job_id)
    if job is None or job.status != "running" or job.attempt != event.attempt:
        return []
    if isinstance(event, LaunchSucceeded):
        return [(job.job_id, JobSucceeded(job_id=job.job_id))]
    if isinstance(event, LaunchFailed):
        return _launch_failed(state, job, event)
    return [(job.job_id, event) for event in _launch_stopped(state, job)]


def may_resume(job: Job) -> bool:
    """J12: a running checkpoint-resume job not already being stopped can be moved."""
    return job.status == "running" and job.spec.checkpoint_resume is not None and not job.moving


def _node_fault(state: SchedulerState, event: NodeLost | NodeUnhealthy) -> list[tuple[str, Event]]:
    """M2: checkpoint-resume jobs on a lost or unhealthy node are moved; other jobs fail only when the
    node is lost. A job still being pre-checked waits for the monitor's verdict."""
    node = event.node_name
    lost = isinstance(event, NodeLost)
    reason = (f"node {node} was lost: {event.reason}" if isinstance(event, NodeLost)
              else f"node {node} is unhealthy: {', '.join(event.problems) or 'a component is faulty'}")
    changes: list[tuple[str, Event]] = []
    for job in state.jobs_on(node):
        if job.spec.checkpoint_resume is not None:
            if may_resume(job):
                changes.append((job.job_id, JobResuming(job_id=job.job_id, attempt=job.attempt, reason=reason,
                                                        lost_nodes=[node] if lost else [])))
        elif lost:
            changes.append((job.job_id, JobFailed(job_id=job.job_id, reason=reason)))
    return changes


def _precheck_result(state: SchedulerState, event: PrecheckCompleted) -> list[tuple[str, Event]]:
    job = state.jobs.get(event.job_id)
    if job is None or not job.prechecking or job.precheck is None or job.precheck.attempt != event.attempt:
        return []
    precheck = job.precheck
    if event.passed:
        # A node may have gone down since it was checked: then the job must not start there.
        down = state.unusable(precheck.placement)
        if down:
            return [(job.job_id, JobPrecheckFailed(
                job_id=job.job_id, attempt=event.attempt, nodes=down,
                reason=f"since the pre-check passed, {_node_states(state, down)}"))]
        return [(job.job_id, JobAdmitted(job_id=job.job_id, attempt=precheck.attempt, flavor=precheck.flavor,
                                         placement=precheck.placement, dropped_flavors=precheck.dropped_flavors))]
    failed = [check for check in event.nodes if not check.passed]
    details = "; ".join(f"{check.node}: {', '.join(check.problems()) or 'did not pass'}" for check in failed)
    return [(job.job_id, JobPrecheckFailed(job_id=job.job_id, attempt=event.attempt,
                                           reason="the pre-check failed" + (f" on {details}" if details else ""),
                                           nodes=[check.node for check in failed]))]


def _slow_node(state: SchedulerState, event: PerformanceDegraded) -> list[tuple[str, Event]]:
    """M6: with the action "reschedule", a job slow on a node is moved, and never placed there again."""
    job = state.jobs.get(event.job_id)
    if event.action != "reschedule" or job is None or job.attempt != event.attempt or not may_resume(job):
        return []
    reason = (f"it is slow on node {event.node}: hardware time / e2e time was {event.ratio:.3g} over "
              f"{event.window} iterations, {event.direction} its threshold of {event.threshold:g}")
    return [(job.job_id, JobResuming(job_id=job.job_id, attempt=job.attempt, reason=reason,
                                     exclude_nodes=[event.node]))]


def _launch_failed(state: SchedulerState, job: Job, event: LaunchFailed) -> list[tuple[str, Event]]:
    if job.resuming is not None:
        return []  # the attempt is being stopped after a fault anyway: its stop decides what follows
    if job.spec.checkpoint_resume is not None and job.stop_requested_by is None and not job.expiring:
        # When a node dies, its peers' collectives fail at once, before its heartbeats are missed: a
        # fault seen on one of the job's nodes now, or within the settle time, explains the failure.
        down = state.unusable(job.placement)
        if not down:
            return []  # settle_failures() decides once the fault would have been seen
        lost = [n for n in down if (node := state.nodes.get(n)) is not None and node.lost]
        return [(job.job_id, JobResuming(job_id=job.job_id, attempt=job.attempt, lost_nodes=lost,
                                         reason=f"{event.reason}, and {_node_states(state, down)}"))]
    restart = job.spec.fault_restart
    if restart is None or job.stop_requested_by is not None or job.expiring:
        return [(job.job_id, JobFailed(job_id=job.job_id, reason=event.reason, exit_code=event.exit_code))]
    if job.restarts >= restart.max_restarts:
        reason = f"{event.reason}; it was already restarted {_times(job.restarts)}, its maximum"
        return [(job.job_id, JobFailed(job_id=job.job_id, reason=reason, exit_code=event.exit_code))]
    # J13/M5: the rest of the attempt is stopped; its LaunchStopped starts the next one.
    return [(job.job_id, JobRestarting(job_id=job.job_id, attempt=job.attempt, restarts=job.restarts + 1,
                                       reason=event.reason, exit_code=event.exit_code))]


def _launch_stopped(state: SchedulerState, job: Job) -> list[Event]:
    """The attempt is down; why it was stopped decides what the job does next."""
    if job.stop_requested_by is not None:
        return [JobStopped(job_id=job.job_id, by=job.stop_requested_by)]
    if job.expiring:
        return [JobExpired(job_id=job.job_id, reason=f"ran past its duration limit of {job.duration}")]
    if job.resuming is not None:
        resumes, limit = job.resumes, state.max_resumes(job) or 0
        if resumes >= limit:
            already = f"it already resumed {_times(resumes)}, its maximum" if resumes else "it may not resume"
            return [JobFailed(job_id=job.job_id, reason=f"{job.resuming.reason}; {already}")]
        return [JobRequeued(job_id=job.job_id, attempt=job.attempt, reason=job.resuming.reason, resumes=resumes + 1)]
    if job.restarting is not None:
        return [_next_attempt(state, job, job.flavor or "", job.placement,
                              f"restart {job.restarts} after {job.restarting.reason}")]
    if job.rescaling is not None:
        # S10: the next attempt starts on the placement held for it.
        growth = job.rescaling
        next_attempt = _next_attempt(state, job, growth.flavor, growth.placement, growth.reason)
        if isinstance(next_attempt, JobAdmitted) and job.spec.checkpoint_resume is not None:
            # M1: a checkpoint-resume job's nodes are pre-checked before every start on new nodes; it
            # leaves its old placement and holds the new one while the monitor checks it.
            return [JobRequeued(job_id=job.job_id, attempt=job.attempt, resumes=job.resumes,
                                reason=f"{growth.reason}; its nodes are pre-checked first"),
                    JobPrechecking(job_id=job.job_id, attempt=job.attempt + 1, flavor=growth.flavor,
                                   placement=growth.placement, dropped_flavors=job.dropped_flavors)]
        return [next_attempt]
    return [JobFailed(job_id=job.job_id, reason="its processes were stopped")]


def _next_attempt(state: SchedulerState, job: Job, flavor: str, placement: list[Placement], why: str) -> Event:
    """Start the next attempt on `placement` when all its nodes can take it; else wait in the queue."""
    down = state.unusable(placement)
    if down:
        return JobRequeued(job_id=job.job_id, attempt=job.attempt, resumes=job.resumes,
                           reason=f"{why}; {_node_states(state, down)}, so it waits for other nodes")
    return JobAdmitted(job_id=job.job_id, attempt=job.attempt + 1, flavor=flavor, placement=placement,
                       dropped_flavors=job.dropped_flavors)


def _node_states(state: SchedulerState, names: list[str]) -> str:
    """`node a is lost, node b is unhealthy (board:0 faulty)`."""
    parts = []
    for name in names:
        node = state.nodes.get(name)
        if node is None:
            parts.append(f"node {name} is unknown")
        elif node.lost:
            parts.append(f"node {name} is lost")
        else:
            parts.append(f"node {name} is unhealthy" + (f" ({', '.join(node.problems)})" if node.problems else ""))
    return ", ".join(parts)


def _times(count: int) -> str:
    return f"{count} time{'s' if count != 1 else ''}"
