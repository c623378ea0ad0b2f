"""The monitor service: nodes, their health, pre-checks, slow iterations, alerts and debug terminals.

- M2 patrol: agents register and heartbeat here. A node silent for `node_lost_seconds` is recorded
  lost; a node whose probed components (sent with each heartbeat) or administrator marks
  (MarkComponent) show a fault is recorded unhealthy, with its problems, and healthy again later.
  The scheduler stops placing work on such nodes and moves the checkpoint-resume jobs on them.
- M1 pre-checks: it follows the scheduler's events; for each JobPrechecking it checks the job's
  nodes (and asks their agents) and records PrecheckCompleted, which admits or requeues the job.
- M6 performance: it reads job log chunks as they stream (`performance.logfeed`) and records
  PerformanceDegraded when a rank's hardware / e2e time crosses the job's threshold (see
  `performance.detector`).
- L9 watches: whoever watches a job (the gateway's follow streams) is pushed its changes and new log chunks
  as the monitor folds and reads them (`watches`).
- M7 alerts: one AlertRaised per incident, mailed by `mailer`; also one per upstream message any
  service set aside (it follows every service's UpstreamMessageSetAside records, its own included).
- R1, R2 runs: the life of each job's run follows the launcher's process events and the scheduler's job
  ends (`runs.runlife`); its series are read on demand from the metrics stream (`runs.reader`).
- J15 debug terminals: environments of failed or expired jobs are kept for their retention and
  then released (`retention`); OpenTerminal opens a session in one (`terminal`).
- Archived jobs: on the scheduler's JobArchived everything held of the job goes (`archived`), so that memory
  holds the jobs running or ended within the retention, not every job there ever was; the questions about it
  are answered from its history read back from the events stream (`archive`).

What to record is decided in `rules`, and the requests are answered in `handlers`; this module wires
them to the state, the upstreams, the heartbeat subscription and the loops.
Heartbeats and probes are not events (they would flood the log): after a restart every known node
gets a full grace period, and the problems last recorded stand until its next probe. Everything
else is rebuilt from the monitor's log and by replaying the scheduler's events, after the latest snapshot of
the state (libs.skeleton.snapshots: its own state, the jobs as the scheduler's events left them, the nodes' latest
cache reports and the attempts watched for performance). Agents are only called outside the service lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import ClassVar, Self

import msgspec
from nats.aio.msg import Msg

from libs.auth import AuthError
from libs.contracts import subjects
from libs.contracts.agent import AnnounceNodes, Heartbeat
from libs.contracts.cluster import ClusterConfig
from libs.contracts.codec import decode, encode
from libs.contracts.datacache import CacheReport
from libs.contracts.events import (
    AlertRaised,
    DatasetPreloadRequested,
    DebugEnvironmentKept,
    EventEnvelope,
    JobArchived,
    JobPrechecking,
    JobPredicted,
    PerformanceDegraded,
    PrecheckCompleted,
    SettingsChanged,
)
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlSigner
from libs.eventstore import ConcurrencyConflict, NewEvent, Tracking
from libs.eventstore.published import PublishedIndex
from libs.jobstatus import JobLifecycle
from libs.messaging.batches import Batches
from libs.messaging.reader import stream_sequence
from libs.messaging.rpc import serve_operations
from libs.natsroles import (
    CACHE_REPORTS_CONSUMER,
    MONITOR_LOGS_CONSUMER,
    SET_ASIDE_CONSUMER,
    events_consumer,
    queue_group,
)
from libs.skeleton.eventsourced import EventSourcedService, Loop, Upstream, aggregate_of, consumer_span
from libs.skeleton.runtime import ServiceRuntime
from libs.skeleton.snapshots import SavedLifecycle, load_lifecycle, save_lifecycle
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers
from services.monitor import caches, metrics, precheck, rules
from services.monitor.handlers import AgentRequests, UserRequests, node_credential
from services.monitor.kept import KeptEnvironment
from services.monitor.mailer import Mailer
from services.monitor.performance.detector import Incident, PerformanceDetector
from services.monitor.performance.logfeed import follow_logs
from services.monitor.retention import Retention
from services.monitor.rules import Outcome
from services.monitor.runs import runlife
from services.monitor.runs.archive import PastJobs
from services.monitor.runs.reader import RunReader
from services.monitor.state import MonitoredNode, MonitorState, SavedMonitorState
from services.monitor.watches import JobWatching

SCHEDULER_CONSUMER = events_consumer("scheduler")  # tracking row in the monitor's schema
LAUNCHER_CONSUMER = events_consumer("launcher")  # R1: the launcher's process events, for the runs' lives
# An ignored heartbeat is logged at most this often per node: an agent without a valid credential
# sends one every few seconds.
UNCREDENTIALED_LOG_SECONDS = 60.0
UNKNOWN_NODE_ASK_SECONDS = 10.0  # how often a node heard but unknown is asked to register
log = get_logger(__name__)


class Monitor(EventSourcedService):
    name = "monitor"
    # What a snapshot of its state depends on: the state and its folds (its runs' and the jobs' too), the
    # performance detector's watches, and the contracts it holds.
    snapshot_code: ClassVar[tuple[str, ...]] = (
        "services/monitor/service.py", "services/monitor/state.py", "services/monitor/kept.py",
        "services/monitor/runs/runlife.py", "services/monitor/performance/detector.py", "libs/jobstatus.py",
        "libs/contracts/*.py", "libs/skeleton/eventsourced.py", "libs/skeleton/snapshots.py")

    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig) -> None:
        super().__init__(runtime)
        self.cluster = cluster
        self.secret = runtime.settings.require_auth_secret()
        self.signer = ControlSigner.of(self.secret, "monitor")  # its requests to agents (libs/controlsign.py)
        self.state = MonitorState(mailing=bool(runtime.settings.smtp_url))
        self.reports: dict[str, CacheReport] = {}  # D1, D2: each node's latest cache report (its live view)
        self.preloading: set[asyncio.Task[None]] = set()  # D2: preloads being handed to agents
        self.jobs = JobLifecycle()  # the scheduler's jobs and settings, never written here
        # Archived jobs, read back from the events stream and the log when asked about, by where the scheduler's
        # events about them are (`past_index`).
        self.past_index = PublishedIndex(runtime.store)
        self.past = PastJobs(runtime.js, runtime.store, self.past_index)
        # L9: what happens to a job, pushed to its watchers
        self.watching = JobWatching(runtime.nc, self.jobs, self.past)
        self.heartbeat_seconds = runtime.settings.heartbeat_seconds
        self.refused_beats_logged: dict[str, float] = {}  # node -> when its ignored heartbeat was last logged
        self.heartbeats = Batches(self.on_heartbeats)
        self.unknown_asked: dict[str, float] = {}  # node -> when it was last asked to register
        self.lost_after = runtime.settings.node_lost_seconds
        self.operators = list(runtime.settings.alert_emails)
        self.detector = PerformanceDetector(self.state.incidents)
        self.mailer = Mailer(runtime.settings.smtp_url, runtime.settings.alert_from,
                             pending=lambda: list(self.state.unmailed.values()), mailed=self._mailed)
        self.retention = Retention(runtime.nc, self.signer, self.state.keeping, self.state.nodes,
                                   caught_up=self.caught_up, released=self._released)

    @classmethod
    def create(cls, runtime: ServiceRuntime) -> Self:
        return cls(runtime, ClusterConfig.load(runtime.settings.cluster_config))

    # --- state, upstreams, handlers, loops -------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        self.state.apply(envelope, time.monotonic())

    def save_state(self) -> bytes:
        return _ENCODER.encode(_Saved(
            state=self.state.saved(), jobs=save_lifecycle(self.jobs), reports=list(self.reports.values()),
            watched=[job_id for job_id in self.jobs.jobs if self.detector.watching(job_id)]))

    def load_state(self, data: bytes) -> None:
        """Everything in place in the maps the parts of the monitor read: its state, the scheduler's jobs, the
        latest cache reports; the attempts watched for performance from their jobs' admissions (their windows begin
        empty, as after a rebuild)."""
        saved = _DECODER.decode(data)
        del data  # read: let it go before the state is made of it (the base keeps no other reference)
        self.state.load(saved.state, time.monotonic())
        load_lifecycle(saved.jobs, into=self.jobs)
        self.reports.clear()
        self.reports.update((report.node, report) for report in saved.reports)
        for job_id in saved.watched:
            job = self.jobs.jobs.get(job_id)
            resume = job.spec.checkpoint_resume if job is not None else None
            if job is not None and resume is not None and resume.performance is not None:
                self.detector.watch(job_id, job.attempt, resume.performance,
                                    {place.rank: place.node for place in job.placement})

    def apply(self, envelope: EventEnvelope) -> None:
        """Fold one of the monitor's own events as the base does. An alert's version is kept only while its mail
        is awaited (AlertMailed is recorded to it): one per alert ever raised would grow without end. Raising an
        alert again then finds its id taken in the log (`record`)."""
        super().apply(envelope)
        if envelope.aggregate_type == "alert" and envelope.aggregate_id not in self.state.unmailed:
            self.forget("alert", envelope.aggregate_id)

    def follow(self, envelope: EventEnvelope, sequence: int = 0) -> list[int]:
        """Fold a scheduler event: the job's state, and which attempts are watched for performance; an archived
        job's everything goes. Where the event is stored (`sequence`, 0: unknown) is noted with the job's; the
        sequences of a job that is no longer held (archived now, or before) are returned, to be written down."""
        self.detector.follow(envelope, self.jobs.apply(envelope))
        left: list[int] = []
        if envelope.aggregate_type == "job":
            job_id = envelope.aggregate_id
            self.watching.changed(job_id)
            self.past.changed(job_id)
            noted = self.state.published.setdefault(job_id, []) if sequence else []
            if sequence and (not noted or noted[-1] < sequence):
                noted.append(sequence)
            if isinstance(envelope.event, JobArchived):
                left = self.state.published.get(job_id, [])
                self.archived(job_id)
            elif job_id not in self.jobs.jobs:  # an event about a job archived before (a command on it)
                left = self.state.published.pop(job_id, [])
        self.wake.set()  # as the base does after every fold
        return left

    def archived(self, job_id: str) -> None:
        """The scheduler archived the job (it ended more than the retention ago, its environment released): all
        that is held of it goes, its own aggregates' versions too (nothing is recorded to them again)."""
        self.state.forget_job(job_id)
        self.detector.unwatch(job_id)
        self.watching.forget(job_id)
        self.retention.forget(job_id)
        for aggregate_type in ("job", "run"):
            self.forget(aggregate_type, job_id)

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("scheduler", "job", "settings",
                                                                                   "preload"),
                         consumer=SCHEDULER_CONSUMER, message_type=EventEnvelope, handle=self.on_scheduler_event),
                Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.SET_ASIDE_ALL, consumer=SET_ASIDE_CONSUMER,
                         message_type=EventEnvelope, react=self.alert_set_aside),
                Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("autoscaler", "instance"),
                         consumer=events_consumer("autoscaler"), message_type=EventEnvelope,
                         fold=self.state.apply_autoscaler,
                         react=lambda envelope: rules.autoscaler_event(envelope, self.state.nodes, self.jobs,
                                                                       self.operators).changes),
                Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("launcher", "launch"),
                         consumer=LAUNCHER_CONSUMER, message_type=EventEnvelope, react=self.run_reaction,
                         fold=lambda envelope: self.watching.changed(envelope.aggregate_id),  # its instances
                         key=aggregate_of, react_after=self.run_reaction),
                Upstream(stream=subjects.CACHE_REPORTS_STREAM, subject=subjects.CACHE_REPORTS_ALL,
                         consumer=CACHE_REPORTS_CONSUMER, message_type=CacheReport, handle=self.on_cache_report,
                         # Only the node's own agent reports its cache: another's report is set aside.
                         check=lambda report, subject: subjects.sender_refusal(subject, report.node))]

    def run_reaction(self, envelope: EventEnvelope, waiting: Sequence[NewEvent] = ()) -> list[NewEvent]:
        """R1: a launcher event's answer for the job's run (it begins, goes on, a rank ends, it finishes), after
        the run events `waiting` to be recorded with it (a start and an end that arrived together)."""
        job_id = envelope.aggregate_id
        life = runlife.life_after(self.state.runs.get(job_id), job_id, waiting)
        return runlife.on_process_event(envelope, life, self._tasks(job_id))

    def _tasks(self, job_id: str) -> int:
        """How many tasks the job has: its rank 0s make its run's primary (1 unless it is a batch job)."""
        job = self.jobs.jobs.get(job_id)
        return max(1, len(job.spec.tasks)) if job is not None else 1

    def alert_set_aside(self, envelope: EventEnvelope) -> list[NewEvent]:
        return rules.set_aside(envelope, self.operators).changes

    def handlers(self) -> None:
        agents = AgentRequests(self, secret=self.secret, heartbeat_seconds=self.heartbeat_seconds)
        people = UserRequests(self, nc=self.rt.nc, signer=self.signer, store=self.rt.store)
        # R2: every job's run, an archived one's too, read from the metrics stream
        runs = RunReader(self.rt.js, self.jobs, self.state.runs, self.past)
        serve_operations(self.rt.broker, self.name,
                         [*agents.routes(), *people.routes(), *runs.routes(), *self.watching.routes()],
                         secret=self.secret)

    async def prepare(self) -> None:
        await self.past_index.migrate()
        # Heartbeats come by the thousand a second and mostly change nothing: taken in batches, not by faststream.
        await self.heartbeats.subscribe(self.rt.nc, subjects.HEARTBEAT_ALL, queue=queue_group(self.name))

    def loops(self) -> Mapping[str, Loop]:
        return {"heartbeats": self.heartbeats.run, "patrol": self.patrol, "mailer": self.mailer.run,
                "retention": self.retention.run, "release": self.retention.run_releases,
                "performance": self.performance_loop, "announce": self.ask_nodes_to_register,
                "pushes": self.watching.send, "watches": self.watching.sweep}

    async def ask_nodes_to_register(self) -> None:
        """Every agent registers again once this monitor acts: whatever its log lost (or a standby that took
        over never heard), the nodes come back."""
        await self.caught_up()
        await self.announce([])

    async def announce(self, nodes: list[str]) -> None:
        await self.rt.nc.publish(subjects.ANNOUNCE_NODES, encode(AnnounceNodes(nodes=nodes)))
        log.info("node.announce_asked", nodes=nodes or "all")

    # --- recording ------------------------------------------------------------------------------------

    async def record(self, changes: Sequence[NewEvent], tracking: Tracking | None = None) -> list[EventEnvelope]:
        """Record as the base does, a run lived whole as one RunLived; an alert whose id is taken was raised before
        and is left out (its version is known while its mail is awaited, else the log is asked once the append finds
        it taken)."""
        fresh = runlife.compacted([c for c in changes if not self._raised_before(c)])
        try:
            return await super().record(fresh, tracking)
        except ConcurrencyConflict:
            taken = [c for c in fresh if isinstance(c.event, AlertRaised)
                     and await self.rt.store.read_aggregate("alert", c.aggregate_id)]
            if not taken:
                raise
            log.info("alert.already_raised", alert_ids=[c.aggregate_id for c in taken])
            return await self.record([c for c in fresh if c not in taken], tracking)

    def _raised_before(self, change: NewEvent) -> bool:
        return isinstance(change.event, AlertRaised) and self.version("alert", change.aggregate_id) > 0

    async def carry_out(self, outcome: Outcome, tracking: Tracking | None = None) -> bool:
        """Record a decision's events and alerts in one append, then have its workspaces released."""
        recorded = await self.record(outcome.changes, tracking)
        for release in outcome.releases:
            self.retention.release_soon(release.job_id, release.nodes)
        return bool(recorded)

    def sample_metrics(self) -> None:
        metrics.sample(self.state)

    def recorded(self, envelope: EventEnvelope) -> None:
        metrics.count(envelope)
        event, name = envelope.event, type(envelope.event).name()
        if isinstance(event, AlertRaised):
            log.info("alert.raised", alert_id=event.alert_id, kind=event.kind, job_id=event.job_id, node=event.node)
            self.mailer.wake()
        elif envelope.aggregate_type == "node":
            log.info("node.event", node=envelope.aggregate_id, event_type=name)
        elif envelope.aggregate_type == "job":
            log.info("job.event", job_id=envelope.aggregate_id, event_type=name)
            if isinstance(event, DebugEnvironmentKept):
                self.retention.wake.set()
            elif isinstance(event, PrecheckCompleted):
                log.info("precheck.done", job_id=event.job_id, attempt=event.attempt, passed=event.passed,
                         failed_nodes=[c.node for c in event.nodes if not c.passed])
            elif isinstance(event, PerformanceDegraded):
                log.info("performance.degraded", job_id=event.job_id, attempt=event.attempt, rank=event.rank,
                         node=event.node, ratio=event.ratio, action=event.action)

    async def _mailed(self, alert: AlertRaised) -> None:
        async with self.lock:
            await self.carry_out(rules.mailed(alert, self.state.unmailed))

    async def _released(self, kept: KeptEnvironment) -> None:
        async with self.lock:
            await self.carry_out(rules.released(kept))

    # --- nodes: heartbeats and the patrol (M2; registrations and marks are answered in handlers.py) -----

    async def on_heartbeats(self, batch: Sequence[Msg]) -> None:
        """Each node's latest heartbeat of the batch (an older one of the same node says nothing more), checked
        and decided on under one hold of the lock; most change nothing but when the node was last seen. Every
        node of the batch is seen before any decision is recorded, so that the database away for a while
        loses no node its heartbeat."""
        latest: dict[str, tuple[Heartbeat, str | AuthError]] = {}
        for msg in batch:
            try:
                beat = decode(msg.data, Heartbeat)
            except msgspec.DecodeError:
                continue
            if (why := subjects.sender_refusal(msg.subject, beat.node)) is not None:  # another node's name
                self._log_ignored_heartbeat(beat.node, CommandError(code="forbidden", message=why))
                continue
            latest[beat.node] = (beat, node_credential(self.secret, msg.headers))
        async with self.lock:
            heard = [found for beat, credential in latest.values()
                     if (found := await self._heard(beat, credential)) is not None]
            for node, beat in heard:
                outcome = rules.heartbeat(node, self.version("node", node.name), self.jobs, self.operators,
                                          disk_pressure=beat.disk_pressure)
                if outcome.changes or outcome.releases:
                    await self.carry_out(outcome)

    async def _heard(self, beat: Heartbeat, credential: str | AuthError) -> tuple[MonitoredNode, Heartbeat] | None:
        """The node a heartbeat is from, seen now with its probe; None when the heartbeat is not taken."""
        node = self.state.nodes.get(beat.node)
        if node is None:
            await self._ask_unknown(beat.node)
            return None
        if (refusal := rules.credential_refusal(beat.node, credential)) is not None:
            self._log_ignored_heartbeat(beat.node, refusal)
            return None
        node.last_seen = time.monotonic()
        node.probed = list(beat.health)
        return node, beat

    async def _ask_unknown(self, node: str) -> None:
        """A heartbeat of a node this monitor does not know (its log lost it): ask it, at most every
        UNKNOWN_NODE_ASK_SECONDS, to register."""
        now = time.monotonic()
        if now - self.unknown_asked.get(node, -UNKNOWN_NODE_ASK_SECONDS) >= UNKNOWN_NODE_ASK_SECONDS:
            self.unknown_asked[node] = now
            await self.announce([node])

    def _log_ignored_heartbeat(self, node: str, refusal: CommandError) -> None:
        now = time.monotonic()
        if now - self.refused_beats_logged.get(node, -UNCREDENTIALED_LOG_SECONDS) >= UNCREDENTIALED_LOG_SECONDS:
            self.refused_beats_logged[node] = now
            log.warning("node.heartbeat_ignored", node=node, code=refusal.code, reason=refusal.message,
                        hint=refusal.hint)

    async def patrol(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_seconds, self.lost_after / 4))
            if not self.rt.hearing:  # no heartbeat can arrive: nobody is overdue until NATS is back
                continue
            async with self.lock:
                now = time.monotonic()
                for node in self.state.overdue(now, self.lost_after, self.rt.hearing_since):
                    await self.carry_out(rules.lost(node, self.version("node", node.name), now, datetime.now(UTC),
                                                    self.jobs, self.operators,
                                                    released=self.state.released.get(node.name)))

    # --- the scheduler's events: pre-checks, moves, ends ---------------------------------------------

    async def on_scheduler_event(self, envelope: EventEnvelope, msg: Msg, tracking: Tracking | None) -> bool:
        """Fold every event; answer each new one, recorded with its tracking position. A pre-check asks
        the agents, outside the lock."""
        event = envelope.event
        async with self.lock:
            settings = self.jobs.settings  # as before this event
            left = self.follow(envelope, stream_sequence(msg))
            if tracking is None:
                return False
            if left:  # no longer held: where its events are is noted at once, and written down
                self.past_index.note(envelope.aggregate_id, left)
            await self.past_index.write(envelope.aggregate_id)
            if isinstance(event, SettingsChanged) and rules.cache_policy(event.settings) != rules.cache_policy(
                    settings):
                await self.announce([])  # the agents register again, and get the new cache policy (D1)
            if isinstance(event, DatasetPreloadRequested):  # D2: each node's agent copies it, in the background
                self._stage_on(event.preload_id, [(node, event.source) for node in event.nodes])
                return False
            if isinstance(event, JobPredicted) and (warm := caches.warm_ups(event, self._spec(event.job_id))):
                self._stage_on(event.job_id, warm)  # D1: a job that waits starts with its data in the cache
                return False
            if not isinstance(event, JobPrechecking):
                job = self.jobs.jobs.get(envelope.aggregate_id)
                outcome = rules.reaction(envelope, job, self.jobs.settings, self.operators)
                outcome.events += runlife.on_job_event(envelope, self.state.runs.get(envelope.aggregate_id),
                                                       self._tasks(envelope.aggregate_id))
                if not outcome.changes and not outcome.releases:
                    return False  # most of a job's events ask nothing of the monitor: no span for them
                with consumer_span(self._tracer, envelope, None, consumer=SCHEDULER_CONSUMER):
                    return await self.carry_out(outcome, tracking)
            if self.state.was_prechecked(event.job_id, event.attempt):
                return False
            plan = precheck.plan(event, self.cluster.flavor(event.flavor), self.state.nodes)
        with consumer_span(self._tracer, envelope, None, consumer=SCHEDULER_CONSUMER):
            checks = await precheck.check_nodes(self.rt.nc, self.signer, event.job_id, plan)
            async with self.lock:
                if self.state.was_prechecked(event.job_id, event.attempt):
                    return False
                job = self.jobs.jobs.get(event.job_id)
                return await self.carry_out(rules.precheck_result(event, checks, job, self.operators), tracking)

    # --- job logs: performance detection (M6) -----------------------------------------------------------

    async def performance_loop(self) -> None:
        await self.caught_up()  # which jobs to watch comes from the scheduler's events
        await follow_logs(self.rt.js, MONITOR_LOGS_CONSUMER, self.detector, self._record_incidents,
                          stored=self.watching.stored)

    async def _record_incidents(self, incidents: list[Incident]) -> None:
        async with self.lock:
            for incident in incidents:
                job = self.jobs.jobs.get(incident.job_id)
                recorded = self.state.incidents.get((incident.job_id, incident.attempt, incident.rank), 0)
                outcome = rules.performance(incident, recorded, job, self.operators)
                if outcome.events:
                    with self._tracer.start_as_current_span(
                            "monitor performance", context=context_from_headers(job.trace if job else None),
                            attributes={"trainyard.job.id": incident.job_id, "trainyard.attempt": incident.attempt,
                                        "trainyard.rank": incident.rank, "trainyard.node": incident.node}):
                        await self.carry_out(outcome)

    # --- the nodes' dataset caches (D1, D2) -----------------------------------------------------------------

    async def on_cache_report(self, report: CacheReport, msg: Msg, tracking: Tracking | None) -> bool:
        """Keep a node's latest report; record what it changed (cached, evicted) once, with its position. A report
        not from the node it names never comes here (the upstream's `check` sets it aside)."""
        async with self.lock:
            self.reports[report.node] = report
            if tracking is None:
                return False
            return await self.carry_out(rules.cache_report(report, self.state.cached.get(report.node, {})),
                                        tracking)

    def _stage_on(self, preload_id: str, copies: list[tuple[str, str]]) -> None:
        task = asyncio.create_task(caches.stage_on(self.rt.nc, self.signer, preload_id, copies))
        self.preloading.add(task)
        task.add_done_callback(self.preloading.discard)

    def _spec(self, job_id: str) -> JobSpec | None:
        job = self.jobs.jobs.get(job_id)
        return job.spec if job is not None else None


class _Saved(msgspec.Struct, array_like=True):
    """A snapshot of the monitor: its state, the scheduler's jobs and settings as folded, each node's latest cache
    report, and the jobs whose current attempt is watched for performance."""

    state: SavedMonitorState
    jobs: SavedLifecycle
    reports: list[CacheReport]
    watched: list[str]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Saved)
