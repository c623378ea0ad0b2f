"""The launcher service: turns admissions into processes on node agents and reports how they end.

It follows the scheduler's job events (admissions and stops) and the agents' process reports. What
it decides is recorded first (LaunchPlanned, NodeProcessStarted, ...); talking to agents happens
after, in a dispatcher that re-sends until the agents confirm. Agents treat a repeated start of the
same (job, attempt, rank) as already done, so a restart neither launches twice nor forgets a job.
A stop is not sent again while one is out: a checkpoint-resume job gets the checkpoint signal once
and its whole graceful shutdown time (stopping.py). Processes on a node the scheduler found lost are
given up at once, since nothing there will answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable

from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.agent import (
    AgentReply,
    ProcessExited,
    ProcessReport,
    ProcessStarted,
    StartProcess,
)
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LaunchSucceeded,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
)
from libs.eventstore import NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.messaging.rpc import ServiceUnavailable, call
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.launcher.planner import plan_launch
from services.launcher.state import Launch, LauncherState, Unit
from services.launcher.stopping import reply_timeout, stop_request

SERVICE = "launcher"
RESEND_SECONDS = 5.0
SendKey = tuple[str, int, object, str]  # (what, attempt, rank or node, job id)
log = get_logger(__name__)
span_tracer = tracer("trainyard.launcher")


class Launcher:
    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig) -> None:
        self.rt = runtime
        self.cluster = cluster
        self.state = LauncherState()
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.followers: list[StreamFollower] = []
        # When a start or stop was last sent, per (job, attempt, rank or node), and which nodes
        # confirmed a stop: in memory only, so after a restart everything unconfirmed is sent again.
        self._sent: dict[SendKey, float] = {}
        self._in_flight: set[SendKey] = set()
        self._stop_confirmed: dict[tuple[str, int], set[str]] = {}
        self._unanswered_since: dict[tuple[str, int, str], float] = {}

    async def start(self) -> None:
        async for envelope in self.rt.store.read_all():
            self.state.apply(envelope)
        log.info("launcher.rebuilt", launches=len(self.state.launches))
        self.followers = [
            StreamFollower(self.rt.js, self.rt.store, stream=subjects.EVENTS_STREAM,
                           subject=subjects.events_of_service("scheduler"), consumer="scheduler-events",
                           message_type=EventEnvelope, handle=self.on_scheduler_event),
            StreamFollower(self.rt.js, self.rt.store, stream=subjects.AGENT_REPORTS_STREAM,
                           subject=subjects.AGENT_REPORTS_ALL, consumer="agent-reports",
                           message_type=ProcessReport, handle=self.on_agent_report),
        ]
        for follower in self.followers:
            await follower.start()
        self.rt.spawn(self.dispatch_loop(), "dispatch")

    async def _append(self, job_id: str, events: list[Event], tracking: Tracking | None) -> None:
        stored = await self.rt.store.append(
            [NewEvent("launch", job_id, e) for e in events],
            expected_versions={("launch", job_id): self.state.versions.get(job_id, 0)},
            tracking=tracking, trace=current_trace_headers(),
        )
        for envelope in stored:
            self.state.apply(envelope)
            log.info("launch.event", job_id=job_id, event_type=type(envelope.event).name())
        self.wake.set()

    # --- scheduler events -------------------------------------------------------------------------

    async def on_scheduler_event(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        async with self.lock:
            self.state.apply(envelope)
            self.wake.set()
            event = envelope.event
            if tracking is None or not isinstance(event, JobAdmitted):
                return False
            launch = self.state.launches.get(event.job_id)
            if launch is not None and launch.attempt >= event.attempt:
                return False
            with span_tracer.start_as_current_span("launcher plan", context=context_from_headers(envelope.trace)):
                await self._append(event.job_id, [self._plan(event)], tracking)
            return True

    def _plan(self, admission: JobAdmitted) -> Event:
        spec = self.state.specs.get(admission.job_id)
        flavor = self.cluster.flavor(admission.flavor)
        if spec is None or flavor is None:
            return LaunchFailed(job_id=admission.job_id, attempt=admission.attempt,
                                reason=f"the launcher does not know the job's spec or flavor {admission.flavor}")
        base_port = self.state.free_ports(len(admission.placement))
        nodes = plan_launch(spec, flavor, admission.placement, master_port=base_port, job_id=admission.job_id,
                            resumes=self.state.resumes.get(admission.job_id, 0))
        return LaunchPlanned(job_id=admission.job_id, attempt=admission.attempt, mode=spec.mode, nodes=nodes,
                             base_port=base_port)

    # --- agent reports ----------------------------------------------------------------------------

    async def on_agent_report(self, report: ProcessStarted | ProcessExited, msg: Msg,
                              tracking: Tracking | None) -> bool:
        if tracking is None:
            return False
        async with self.lock:
            launch = self.state.launches.get(report.job_id)
            if launch is None or launch.attempt != report.attempt:
                return False
            events = self._record_report(launch, report)
            if not events:
                return False
            with span_tracer.start_as_current_span("launcher report", context=context_from_headers(msg.headers)):
                await self._append(launch.job_id, events, tracking)
            return True

    def _record_report(self, launch: Launch, report: ProcessStarted | ProcessExited) -> list[Event]:
        unit = (report.task, report.rank)
        key = dict(job_id=launch.job_id, attempt=launch.attempt, task=report.task, rank=report.rank,
                   node=report.node)
        if isinstance(report, ProcessStarted):
            if unit in launch.started or unit in launch.exited:
                return []
            return [NodeProcessStarted(pid=report.pid, backend=report.backend, **key)]  # type: ignore[arg-type]
        if unit in launch.exited:
            return []
        events: list[Event] = [NodeProcessExited(exit_code=report.exit_code, **key)]  # type: ignore[arg-type]
        if launch.outcome is not None:
            return events
        if self.state.stop_wanted(launch):
            return events  # the dispatcher records LaunchStopped once every node confirmed
        if launch.node_of(unit).role != "worker" and launch.task_done(report.task):
            return events  # a finished task's parameter server or standby, stopped on purpose
        if report.exit_code != 0:
            task = f"task {report.task + 1}: " if len(launch.tasks()) > 1 else ""
            events.append(LaunchFailed(
                job_id=launch.job_id, attempt=launch.attempt, exit_code=report.exit_code,
                reason=f"{task}rank {report.rank} on {report.node} exited with code {report.exit_code}"))
            return events
        # Parameter servers serve until the workers are done; the dispatcher then stops them. A batch
        # job's next task starts once this one is done (the dispatcher finds its units pending).
        if launch.finished_with(unit, report.exit_code):
            events.append(LaunchSucceeded(job_id=launch.job_id, attempt=launch.attempt))
        return events

    # --- talking to agents ------------------------------------------------------------------------

    async def dispatch_loop(self) -> None:
        for follower in self.followers:
            await follower.caught_up.wait()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 1.0)
            self.wake.clear()
            await self.dispatch_once()

    async def dispatch_once(self) -> None:
        """Record what the agents' answers settled, then send what is due."""
        async with self.lock:
            await self._give_up_lost_nodes()
            await self._record_finished_stops()
            work = self._due_work()
        await asyncio.gather(*work)

    async def _give_up_lost_nodes(self) -> None:
        for launch in self.state.active():
            if not self.state.stop_wanted(launch):
                continue
            confirmed = self._stop_confirmed.get((launch.job_id, launch.attempt), set())
            for node in sorted(self.state.lost_nodes_of(launch) - confirmed):
                await self._give_up_node(launch, node, f"node {node} was lost")

    async def _record_finished_stops(self) -> None:
        """A stopped launch ends once every node confirmed the stop and no process still runs."""
        for launch in self.state.active():
            if not self.state.reports_stop(launch) or launch.running():
                continue
            confirmed = self._stop_confirmed.get((launch.job_id, launch.attempt), set())
            if {n.node for n in launch.nodes} <= confirmed:
                with span_tracer.start_as_current_span("launcher stopped", context=context_from_headers(launch.trace)):
                    await self._append(launch.job_id, [LaunchStopped(job_id=launch.job_id, attempt=launch.attempt)],
                                       None)

    def _due_work(self) -> list[asyncio.Future[None]]:
        now = time.monotonic()
        work: list[asyncio.Future[None]] = []
        for launch in self.state.active():
            if self.state.stop_wanted(launch):
                confirmed = self._stop_confirmed.get((launch.job_id, launch.attempt), set())
                running = {launch.node_of(unit).node for unit in launch.running()}
                for node in {n.node for n in launch.nodes} - (confirmed - running):
                    key: SendKey = ("stop", launch.attempt, node, launch.job_id)
                    if self._due(key, now):
                        work.append(self._send(key, self._stop(launch, node)))
                continue
            for unit in launch.leftovers():
                node = launch.node_of(unit).node
                key = ("stop-task", launch.attempt, (unit[0], node), launch.job_id)
                if self._due(key, now):
                    work.append(self._send(key, self._stop(launch, node, task=unit[0])))
            for unit in launch.pending():
                key = ("start", launch.attempt, unit, launch.job_id)
                if self._due(key, now):
                    work.append(self._send(key, self._start(launch, unit)))
        return work

    def _due(self, key: SendKey, now: float) -> bool:
        # Never twice at once: a stop may take a job's whole graceful shutdown time to be answered.
        if key in self._in_flight or now - self._sent.get(key, -RESEND_SECONDS) < RESEND_SECONDS:
            return False
        self._sent[key] = now
        return True

    def _send(self, key: SendKey, request: Awaitable[None]) -> asyncio.Future[None]:
        self._in_flight.add(key)

        async def sending() -> None:
            try:
                await request
            finally:
                self._in_flight.discard(key)
                self._sent[key] = time.monotonic()  # the next one is due a while after this answer

        return asyncio.ensure_future(sending())

    async def _start(self, launch: Launch, unit: Unit) -> None:
        node = launch.node_of(unit)
        request = StartProcess(job_id=launch.job_id, attempt=launch.attempt, launch=node)
        try:
            with span_tracer.start_as_current_span("launcher start", context=context_from_headers(launch.trace)):
                await call(self.rt.nc, subjects.agent_start(node.node), request, timeout=5.0, reply_type=AgentReply)
                log.info("launch.start_sent", job_id=launch.job_id, task=node.task, rank=node.rank, node=node.node)
        except ServiceUnavailable as exc:
            log.warning("launch.agent_unreachable", job_id=launch.job_id, node=node.node, error=str(exc))

    async def _stop(self, launch: Launch, node: str, *, task: int | None = None) -> None:
        request = stop_request(launch, self.state.specs.get(launch.job_id), self.state.settings,
                               default_grace=self.rt.settings.stop_grace_seconds, task=task)
        timeout = reply_timeout(request)
        if task is not None:  # ending one finished task's helpers; the launch goes on
            with contextlib.suppress(ServiceUnavailable):
                await call(self.rt.nc, subjects.agent_stop(node), request, timeout=timeout, reply_type=AgentReply)
            return
        try:
            with span_tracer.start_as_current_span("launcher stop", context=context_from_headers(launch.trace)):
                await call(self.rt.nc, subjects.agent_stop(node), request, timeout=timeout, reply_type=AgentReply)
            self._stop_confirmed.setdefault((launch.job_id, launch.attempt), set()).add(node)
            self._unanswered_since.pop((launch.job_id, launch.attempt, node), None)
            self.wake.set()
            log.info("launch.stop_confirmed", job_id=launch.job_id, node=node)
        except ServiceUnavailable as exc:
            log.warning("launch.agent_unreachable", job_id=launch.job_id, node=node, error=str(exc))
            since = self._unanswered_since.setdefault((launch.job_id, launch.attempt, node), time.monotonic())
            if time.monotonic() - since >= self.rt.settings.stop_give_up_seconds:
                async with self.lock:
                    await self._give_up_node(launch, node, f"node {node} did not answer stop requests for "
                                                           f"{self.rt.settings.stop_give_up_seconds:g}s")

    async def _give_up_node(self, launch: Launch, node: str, reason: str) -> None:
        """A node that cannot answer keeps its processes' fate unknown; record that and move on (the
        caller holds the lock)."""
        units = [unit for unit in launch.running() if launch.node_of(unit).node == node]
        if units:
            with span_tracer.start_as_current_span("launcher give up", context=context_from_headers(launch.trace)):
                await self._append(launch.job_id, [
                    NodeProcessLost(job_id=launch.job_id, attempt=launch.attempt, task=task, rank=rank, node=node,
                                    reason=reason)
                    for task, rank in units], None)
        self._stop_confirmed.setdefault((launch.job_id, launch.attempt), set()).add(node)
        self._unanswered_since.pop((launch.job_id, launch.attempt, node), None)
        self.wake.set()
