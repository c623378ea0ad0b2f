"""The monitor service: nodes, their health, pre-checks, slow iterations, alerts and debug terminals.

- M2 patrol: agents register and heartbeat here. A node silent for `node_lost_seconds` is recorded
  lost; a node whose probed components (sent with each heartbeat) or administrator marks
  (MarkComponent) show a fault is recorded unhealthy, with its problems, and healthy again later.
  The scheduler stops placing work on such nodes and moves the checkpoint-resume jobs on them.
- M1 pre-checks: it follows the scheduler's events; for each JobPrechecking it checks the job's
  nodes (and asks their agents) and records PrecheckCompleted, which admits or requeues the job.
- M6 performance: it reads job log chunks as they stream and records PerformanceDegraded when a
  rank's hardware / e2e time crosses the job's threshold (see `performance`).
- M7 alerts: one AlertRaised per incident, mailed by `mailer`.
- J15 debug terminals: environments of failed or expired jobs are kept for their retention and
  then released (`retention`); OpenTerminal opens a session in one (`terminal`).

Heartbeats and probes are not events (they would flood the log): after a restart every known node
gets a full grace period, and the problems last recorded stand until its next probe. Everything
else is rebuilt from the monitor's log and by replaying the scheduler's events. Agents are only
called outside the service lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec
from faststream.nats.annotations import NatsMessage
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from libs.contracts import subjects
from libs.contracts.agent import Heartbeat, LogChunk, NodeAccepted, RegisterNode
from libs.contracts.cluster import ClusterConfig, Resources
from libs.contracts.codec import decode
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    ComponentMarked,
    DebugEnvironmentKept,
    Event,
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPrechecking,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSucceeded,
    NodeHealthy,
    NodeLost,
    NodeRecovered,
    NodeRegistered,
    NodeUnhealthy,
    PerformanceDegraded,
    PrecheckCompleted,
)
from libs.contracts.health import COMPONENT_PATTERN, NodeCheck
from libs.contracts.identity import Identity
from libs.contracts.messages import CommandError, Done, MarkComponent, OpenTerminal, TerminalOpened
from libs.eventstore import ConcurrencyConflict, NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.messaging.rpc import register_authenticated, register_responder
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.monitor import alerts, precheck
from services.monitor.health import changed, faulty_components, problems_of
from services.monitor.jobs import JobsView
from services.monitor.mailer import Mailer
from services.monitor.performance import Incident, PerformanceDetector
from services.monitor.retention import Retention, kept_event
from services.monitor.state import MonitoredNode, MonitorState, lost_event
from services.monitor.terminal import open_terminal

SERVICE = "monitor"
SCHEDULER_CONSUMER = "scheduler-events"  # tracking row in the monitor's schema
LOGS_CONSUMER = "monitor-logs"  # durable JetStream consumer on TRAINYARD_LOGS
LOGS_PREFIX = "trainyard.logs."
LOG_BATCH = 256
log = get_logger(__name__)
span_tracer = tracer("trainyard.monitor")

PrecheckInputs = tuple[dict[str, Resources], dict[str, NodeCheck | None], dict[str, dict[str, ComponentMarked]]]
# The current attempt of a job is ending (or moving): its log lines no longer count.
ATTEMPT_ENDING = (JobResuming, JobRestarting, JobRescaling, JobRequeued, JobExpiring, JobStopRequested,
                  JobSucceeded, JobFailed, JobStopped, JobExpired, JobDeleted)


class Monitor:
    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig) -> None:
        self.rt = runtime
        self.cluster = cluster
        self.secret = runtime.settings.require_auth_secret()
        self.state = MonitorState()
        self.jobs = JobsView()
        self.lock = asyncio.Lock()
        self.heartbeat_seconds = runtime.settings.heartbeat_seconds
        self.lost_after = runtime.settings.node_lost_seconds
        self.operators = list(runtime.settings.alert_emails)
        self.detector = PerformanceDetector(self.state.incidents)
        self.mailer = Mailer(runtime.settings.smtp_url, runtime.settings.alert_from,
                             pending=lambda: list(self.state.unmailed.values()), mailed=self._mailed)
        self.retention = Retention(self)
        self.follower = StreamFollower(runtime.js, runtime.store, stream=subjects.EVENTS_STREAM,
                                       subject=subjects.events_of_service("scheduler"),
                                       consumer=SCHEDULER_CONSUMER, message_type=EventEnvelope,
                                       handle=self.on_scheduler_event)

    async def start(self) -> None:
        now = time.monotonic()
        async for envelope in self.rt.store.read_all():
            self.state.apply(envelope, now)
        log.info("monitor.rebuilt", nodes=len(self.state.nodes), unmailed_alerts=len(self.state.unmailed))
        broker = self.rt.broker
        register_responder(broker, SERVICE, subjects.REGISTER_NODE, RegisterNode, self.register)
        broker.subscriber(subjects.HEARTBEAT_ALL, queue="trainyard-monitor")(self.on_heartbeat)
        register_authenticated(broker, SERVICE, subjects.MARK_COMPONENT, MarkComponent, self.mark,
                               secret=self.secret)
        register_authenticated(broker, SERVICE, subjects.OPEN_TERMINAL, OpenTerminal, self.open_terminal,
                               secret=self.secret)
        await self.follower.start()
        self.rt.spawn(self.patrol(), "patrol")
        self.rt.spawn(self.mailer.run(), "mailer")
        self.rt.spawn(self.retention.run(), "retention")
        self.rt.spawn(self.retention.run_releases(), "release")
        self.rt.spawn(self.follow_logs(), "performance")

    async def caught_up(self) -> None:
        """Decisions that need the jobs wait until the scheduler's events are replayed."""
        await self.follower.caught_up.wait()

    # --- recording --------------------------------------------------------------------------------

    async def _record(self, changes: Sequence[NewEvent], tracking: Tracking | None = None) -> list[EventEnvelope]:
        """Append and fold; an alert whose id is taken was raised before and is left out."""
        changes = [c for c in changes if c.aggregate_type != "alert" or not self._raised(c)]
        expected: dict[tuple[str, str], int] = {}
        for change in changes:
            key = (change.aggregate_type, change.aggregate_id)
            expected.setdefault(key, self.state.version(*key))
        if not changes:
            return []
        try:
            stored = await self.rt.store.append(changes, expected_versions=expected, tracking=tracking,
                                                trace=current_trace_headers())
        except ConcurrencyConflict:
            others = [c for c in changes if not isinstance(c.event, AlertRaised)]
            if len(others) == len(changes):
                raise
            log.info("alert.already_raised", alert_ids=[c.aggregate_id for c in changes if c not in others])
            return await self._record(others, tracking)
        for envelope in stored:
            self.state.apply(envelope, time.monotonic())
            self._log_recorded(envelope)
        if any(isinstance(e.event, AlertRaised) for e in stored):
            self.mailer.wake()
        if any(isinstance(e.event, DebugEnvironmentKept) for e in stored):
            self.retention.wake.set()
        return stored

    def _raised(self, change: NewEvent) -> bool:
        return isinstance(change.event, AlertRaised) and change.aggregate_id in self.state.alert_versions

    def _log_recorded(self, envelope: EventEnvelope) -> None:
        event, name = envelope.event, type(envelope.event).name()
        if isinstance(event, AlertRaised):
            log.info("alert.raised", alert_id=event.alert_id, kind=event.kind, job_id=event.job_id, node=event.node)
        elif envelope.aggregate_type == "node":
            log.info("node.event", node=envelope.aggregate_id, event_type=name)
        elif envelope.aggregate_type == "job":
            log.info("job.event", job_id=envelope.aggregate_id, event_type=name)

    @staticmethod
    def _alerts(raised: Sequence[AlertRaised]) -> list[NewEvent]:
        return [NewEvent("alert", a.alert_id, a) for a in raised]

    async def record_job(self, job_id: str, events: Sequence[Event], raised: Sequence[AlertRaised] = (),
                         tracking: Tracking | None = None) -> bool:
        """Record events of the monitor's job aggregate, with the alerts they raise, in one append."""
        changes = [NewEvent("job", job_id, e) for e in events] + self._alerts(raised)
        return bool(await self._record(changes, tracking))

    async def record_node(self, name: str, events: Sequence[Event]) -> None:
        """Record node events; a node turning unhealthy, or lost, raises an alert in the same append."""
        node = self.state.nodes.get(name)
        version = node.version if node else 0
        was_healthy = node is None or not node.problems
        changes: list[NewEvent] = []
        for event in events:
            version += 1  # the event's own version names its alert
            changes.append(NewEvent("node", name, event))
            if isinstance(event, NodeUnhealthy) and was_healthy:
                changes += self._alerts([alerts.node_unhealthy(name, version, event.problems,
                                                               self.jobs.running_on(name), self.operators)])
            elif isinstance(event, NodeLost):
                changes += self._alerts([alerts.node_lost(name, version, event.reason, self.jobs.running_on(name),
                                                          self.operators)])
        await self._record(changes)

    async def _mailed(self, alert: AlertRaised) -> None:
        async with self.lock:
            if alert.alert_id in self.state.unmailed:
                await self._record([NewEvent("alert", alert.alert_id,
                                             AlertMailed(alert_id=alert.alert_id, recipients=alert.recipients))])

    # --- nodes: registration, heartbeats, marks, patrol (M2) ------------------------------------------

    async def register(self, request: RegisterNode) -> NodeAccepted:
        info = request.node
        async with self.lock:
            known = self.state.nodes.get(info.name)
            if known is None or known.info != info:
                await self.record_node(info.name, [NodeRegistered(node=info)])
            elif known.lost:
                await self.record_node(info.name, [NodeRecovered(node_name=info.name)])
            self.state.nodes[info.name].last_seen = time.monotonic()
        return NodeAccepted(heartbeat_seconds=self.heartbeat_seconds)

    async def on_heartbeat(self, msg: NatsMessage) -> None:
        try:
            beat = decode(msg.body, Heartbeat)
        except msgspec.DecodeError:
            return
        async with self.lock:
            node = self.state.nodes.get(beat.node)
            if node is None:
                return
            node.last_seen = time.monotonic()
            node.probed = list(beat.health)
            events: list[Event] = [NodeRecovered(node_name=beat.node)] if node.lost else []
            events += health_events(node, node.marks)
            if events:
                await self.record_node(beat.node, events)

    async def mark(self, request: MarkComponent, identity: Identity) -> Done | CommandError:
        if not identity.admin:
            return CommandError(code="forbidden", message="only administrators mark components",
                                hint="ask an administrator to run the drill")
        if not COMPONENT_PATTERN.match(request.component):
            return CommandError(code="invalid-request", message=f"{request.component!r} is not a component",
                                hint="name it <kind>:<name> with kind nic, board or runtime, "
                                     "e.g. board:0, nic:eth0 or runtime:storage")
        async with self.lock:
            node = self.state.nodes.get(request.node)
            if node is None:
                return CommandError(code="not-found", message=f"no such node: {request.node}",
                                    hint="`trainyard nodes` lists the nodes")
            current = node.marks.get(request.component)
            what = f"{request.component} of {request.node}"
            if request.faulty and current is not None and current.reason == request.reason:
                return Done(job_ids=[], message=f"{what} is already marked faulty")
            if not request.faulty and current is None:
                return Done(job_ids=[], message=f"{what} is not marked")
            mark = ComponentMarked(node_name=node.name, component=request.component, faulty=request.faulty,
                                   by=identity.user, reason=request.reason)
            marks = {k: v for k, v in node.marks.items() if k != request.component}
            if request.faulty:
                marks[request.component] = mark
            await self.record_node(node.name, [mark, *health_events(node, marks)])
            status = f"the node has problems: {'; '.join(node.problems)}" if node.problems else "the node is healthy"
        return Done(job_ids=[], message=f"{what} {'marked faulty' if request.faulty else 'mark cleared'}; {status}")

    async def patrol(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_seconds, self.lost_after / 4))
            async with self.lock:
                now = time.monotonic()
                for node in self.state.overdue(now, self.lost_after):
                    await self.record_node(node.name, [lost_event(node, now, datetime.now(UTC))])

    # --- the scheduler's events: pre-checks, moves, ends ---------------------------------------------

    async def on_scheduler_event(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        event = envelope.event
        async with self.lock:
            self.jobs.apply(envelope)
            self._follow_performance(envelope)
            if tracking is None:
                return False
            if not isinstance(event, JobPrechecking):
                with span_tracer.start_as_current_span(f"monitor react {type(event).name()}",
                                                       context=context_from_headers(envelope.trace)):
                    return await self._react(envelope, tracking)
            if (event.job_id, event.attempt) in self.state.prechecked:
                return False
            needed, known, marks = self._precheck_inputs(event)
        with span_tracer.start_as_current_span("monitor precheck", context=context_from_headers(envelope.trace)):
            checks = await precheck.check_nodes(self.rt.nc, event.job_id, needed, known, marks)
            async with self.lock:
                return await self._record_precheck(event, checks, tracking)

    def _follow_performance(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, JobAdmitted):
            job = self.jobs.jobs.get(event.job_id)
            resume = job.spec.checkpoint_resume if job else None
            if resume is not None and resume.performance is not None:
                self.detector.watch(event.job_id, event.attempt, resume.performance)
        elif isinstance(event, ATTEMPT_ENDING):
            self.detector.unwatch(envelope.aggregate_id)

    async def _react(self, envelope: EventEnvelope, tracking: Tracking) -> bool:
        event = envelope.event
        job = self.jobs.jobs.get(envelope.aggregate_id)
        if job is None:
            return False
        settings = self.jobs.settings
        if isinstance(event, JobResuming):
            return await self.record_job(job.job_id, [], [alerts.job_resuming(job, event, settings, self.operators)],
                                         tracking)
        if isinstance(event, JobSucceeded | JobStopped) and job.debug_terminal:
            self.retention.release_soon(job.job_id, job.nodes_used)
            return False
        if not isinstance(event, JobFailed | JobExpired):
            return False
        kept = kept_event(job, envelope.recorded_at, settings)
        raised = ([alerts.checkpoint_job_failed(job, event, settings, self.operators)]
                  if isinstance(event, JobFailed) and job.checkpoint_resume else [])
        recorded = await self.record_job(job.job_id, [kept] if kept else [], raised, tracking)
        if job.debug_terminal:  # workspaces of earlier attempts on other nodes are not kept
            self.retention.release_soon(job.job_id, [n for n in job.nodes_used if n not in job.nodes])
        return recorded

    def _precheck_inputs(self, event: JobPrechecking) -> PrecheckInputs:
        """What each node needs, the verdicts the monitor can give itself, and the nodes' marks."""
        flavor = self.cluster.flavor(event.flavor)
        names = list(dict.fromkeys(p.node for p in sorted(event.placement, key=lambda p: p.rank)))
        if flavor is None:
            unknown = f"the monitor does not know flavor {event.flavor}"
            return ({n: Resources() for n in names},
                    {n: precheck.failed(n, "flavor", unknown) for n in names}, {})
        known = {n: precheck.known_verdict(n, self.state.nodes.get(n)) for n in names}
        marks = {n: dict(node.marks) for n in names if (node := self.state.nodes.get(n)) is not None}
        return precheck.demands(event.placement, flavor), known, marks

    async def _record_precheck(self, event: JobPrechecking, checks: list[NodeCheck], tracking: Tracking) -> bool:
        if (event.job_id, event.attempt) in self.state.prechecked:
            return False
        passed = bool(checks) and all(c.passed for c in checks)
        result = PrecheckCompleted(job_id=event.job_id, attempt=event.attempt, passed=passed, nodes=checks)
        raised = [] if passed else [alerts.precheck_failed(self.jobs.jobs.get(event.job_id), event.job_id,
                                                           event.attempt, checks, self.operators)]
        recorded = await self.record_job(event.job_id, [result], raised, tracking)
        log.info("precheck.done", job_id=event.job_id, attempt=event.attempt, passed=passed,
                 failed_nodes=[c.node for c in checks if not c.passed])
        return recorded

    # --- job logs: performance detection (M6) -----------------------------------------------------------

    async def follow_logs(self) -> None:
        """Read every job's log chunks as they stream; only watched jobs' chunks are decoded."""
        await self.caught_up()
        # A new consumer starts at new messages: past lines are not this monitor's business.
        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.ALL)
        sub = await self.rt.js.pull_subscribe(subjects.LOGS_ALL, durable=LOGS_CONSUMER, stream=subjects.LOGS_STREAM,
                                              config=config)
        log.info("performance.following", consumer=LOGS_CONSUMER)
        while True:
            try:
                batch = await sub.fetch(LOG_BATCH, timeout=5.0)
            except TimeoutError:  # nothing new (nats raises its own subclass, or the builtin)
                continue
            except NatsError as exc:  # a reconnect: the durable consumer is still there
                log.warning("performance.fetch_failed", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            if not batch:  # fetch may come back empty instead of timing out
                continue
            incidents = self._scan(batch)
            if incidents:
                async with self.lock:
                    for incident in incidents:
                        await self._record_incident(incident)
            # Acknowledged once recorded (AckPolicy.ALL: the whole batch); unacknowledged chunks come
            # again, and a window that sees some lines twice still records each incident once.
            with contextlib.suppress(NatsError):
                await batch[-1].ack()

    def _scan(self, batch: Sequence[Msg]) -> list[Incident]:
        incidents: list[Incident] = []
        for msg in batch:
            job_id = msg.subject[len(LOGS_PREFIX):].partition(".")[0]
            if not self.detector.watching(job_id):
                continue
            try:
                chunk = decode(msg.data, LogChunk)
            except msgspec.DecodeError:
                continue
            incidents += self.detector.feed(chunk)
        return incidents

    async def _record_incident(self, incident: Incident) -> None:
        key = (incident.job_id, incident.attempt, incident.rank)
        if self.state.incidents.get(key, 0) >= incident.number:
            return  # recorded before a restart
        job = self.jobs.jobs.get(incident.job_id)
        rule = incident.rule
        event = PerformanceDegraded(job_id=incident.job_id, attempt=incident.attempt, node=incident.node,
                                    rank=incident.rank, ratio=round(incident.ratio, 6), threshold=rule.threshold,
                                    direction=rule.direction, window=rule.window, action=rule.action)
        with span_tracer.start_as_current_span("monitor performance",
                                               context=context_from_headers(job.trace if job else None)):
            await self.record_job(incident.job_id, [event], [alerts.performance(job, incident, self.operators)])
        log.info("performance.degraded", job_id=incident.job_id, attempt=incident.attempt, rank=incident.rank,
                 node=incident.node, ratio=incident.ratio, action=rule.action)

    # --- debug terminal (J15) ---------------------------------------------------------------------------

    async def open_terminal(self, request: OpenTerminal, identity: Identity) -> TerminalOpened | CommandError:
        return await open_terminal(self, request, identity)


def health_events(node: MonitoredNode, marks: dict[str, ComponentMarked]) -> list[Event]:
    """NodeUnhealthy when the node's problems appear or change, NodeHealthy when they are gone."""
    problems = problems_of(faulty_components(node.probed, marks, node.problems))
    if problems and changed(node.problems, problems):
        return [NodeUnhealthy(node_name=node.name, problems=problems)]
    if not problems and node.problems:
        return [NodeHealthy(node_name=node.name)]
    return []
