"""Talking to the node agents: rendezvous ports asked, starts and stops sent until the agents confirm.

An admitted attempt whose mode listens for a rendezvous (PyTorch's master, TensorFlow's tasks) is planned
once its nodes chose the ports (ReservePorts): a port free on the node, never a fixed one. A node that has
not answered within PORTS_WAIT_SECONDS (an older agent, or one that went away) gets the launcher's own
choice instead, so no job waits on it for ever.

What the launcher decided is recorded first; the dispatcher then sends what the launches need, outside
the service lock, and re-sends what stays unconfirmed. Agents treat a repeated start of the same
(job, attempt, rank) as already done, so a restart neither launches twice nor forgets a job. A stop is
not sent again while one is out: a checkpoint-resume job gets the checkpoint signal once and its whole
graceful shutdown time (stopping.py). Processes on a node the scheduler found lost are given up at
once, and those on a node that never answers a stop after a while, since nothing there will answer.

What was sent and confirmed is kept in memory only, so after a restart everything unconfirmed is sent
again; what the answers settle is decided by the pure rules in rules.py and recorded under the lock. It is kept
per job, and only while the job has a launch under way, an attempt to plan or processes given up on a node: a pass
over every launch under way drops the rest, and a job that leaves the state (archived) takes its own along at once
(`forget`), so that memory stays flat however many jobs pass through. An answer that comes for a job no longer
kept changes nothing.

Every request to an agent is sent in a client span of its job's trace named as OpenTelemetry's messaging
conventions name a send, after its subject with the node as `{node}` (`send trainyard.agent.{node}.start`),
with the messaging attributes and the job, attempt, node and rank; what the launcher decides and records
itself (`launcher plan`, `launcher stopped`, `launcher give up`) is in internal spans with the job's id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, suppress
from dataclasses import dataclass, field
from typing import cast

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from libs.auth import issue_job_token
from libs.contracts import subjects
from libs.contracts.agent import (
    MAX_STARTS_PER_REQUEST,
    AgentReply,
    PortsReserved,
    ReservePorts,
    StartProcess,
    StartProcesses,
    StartRefused,
    StartsAnswered,
    StopProcesses,
    TracedStart,
)
from libs.contracts.cluster import ClusterConfig
from libs.contracts.codec import encode
from libs.contracts.operations.base import MAX_REQUEST_BYTES, CommandError
from libs.controlsign import ControlSigner
from libs.eventstore import NewEvent
from libs.messaging.rpc import ServiceUnavailable, call
from libs.skeleton.eventsourced import EventSourcedService
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, job_attributes, tracer
from libs.telemetry.tracing import send_span as agent_request_span
from services.launcher.planner import Unit
from services.launcher.rules import fenced, give_up_node, needs_ports, plan_admission, stopped
from services.launcher.state import Admitted, Launch, LauncherState
from services.launcher.stopping import reply_timeout, stop_request

RESEND_SECONDS = 5.0
# A pass looks at the launches whose jobs changed since the last pass, and at all of them at most this often
# (whatever is due again after a while, a start or a stop left unanswered, is found then): with thousands of
# jobs running, a pass after every folded message over all of them was most of the launcher's time.
LOOK_AT_ALL_SECONDS = 1.0
PORTS_RESEND_SECONDS = 1.0
PORTS_WAIT_SECONDS = 10.0
SendKey = tuple[str, int, object, str]  # (what, attempt, rank or node, job id)
log = get_logger(__name__)
span_tracer = tracer("trainyard.launcher")


class AgentRefused(Exception):
    """The agent answered that it could not do what was asked."""


@dataclass
class JobCalls:
    """What the dispatcher keeps of one job's requests."""

    sent: dict[SendKey, float] = field(default_factory=dict)  # when each request was last sent (or answered)
    stop_confirmed: dict[int, set[str]] = field(default_factory=dict)  # per attempt: the nodes that confirmed a stop
    # Per (attempt, node): since when a stop has gone unanswered.
    unanswered_since: dict[tuple[int, str], float] = field(default_factory=dict)
    # Per attempt not planned yet: the ports each node chose, and when the launcher first wanted them.
    chosen: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    wanted_since: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, str] = field(default_factory=dict)  # per attempt: its job token (`_job_token`)


def internal_span(name: str, trace: Mapping[str, str] | None, job_id: str, **attributes: str | int
                  ) -> AbstractContextManager[otel_trace.Span]:
    """A span of the launcher's own work for a job (no message), continuing the job's trace."""
    return span_tracer.start_as_current_span(name, context=context_from_headers(trace),
                                             attributes=job_attributes(job_id, **attributes))


def send_span(subject_of: Callable[[str], str], node: str, trace: Mapping[str, str] | None, job_id: str,
              **attributes: str | int) -> AbstractContextManager[otel_trace.Span]:
    """The client span of a request to `node`'s agent, in the job's trace (`send trainyard.agent.{node}.start`)."""
    return agent_request_span(span_tracer, subject_of, node, job_id=job_id, trace_headers=trace or {}, **attributes)


class Dispatcher:
    """Sends the starts and stops the launches of `state` need; records through `service`."""

    def __init__(self, service: EventSourcedService, state: LauncherState, cluster: ClusterConfig) -> None:
        self.service = service
        self.state = state
        self.cluster = cluster
        # The secret issues job tokens; the key derived from it signs every request to an agent.
        self.secret = service.rt.settings.require_auth_secret()
        self.signer = ControlSigner.of(self.secret, "launcher")
        # Per job the state holds with a launch under way, an attempt to plan or processes given up: what was sent
        # and answered for it (`_calls_of`).
        self._calls: dict[str, JobCalls] = {}
        self._in_flight: set[SendKey] = set()  # requests out now, whoever still keeps their job
        self._outstanding: set[asyncio.Future[None]] = set()  # requests sent and not yet answered
        self._looked_at_all = -LOOK_AT_ALL_SECONDS  # when a pass last looked at every launch under way

    async def dispatch_once(self) -> None:
        """Record what the agents' answers settled, then send what is due and wait for the answers."""
        await asyncio.gather(*await self.dispatch())

    async def dispatch(self) -> list[asyncio.Future[None]]:
        """Record what the agents' answers settled, then send what is due without waiting for the answers: a
        slow agent holds up neither the plans of new admissions nor the starts on other nodes (a request is
        never out twice at once, `_due`)."""
        async with self.service.lock:
            now = time.monotonic()
            touched = self.state.take_touched()
            among = None if now - self._looked_at_all >= LOOK_AT_ALL_SECONDS else touched
            if among is None:
                self._looked_at_all = now
                self._keep_calls_needed()
            await self._give_up_lost_nodes(among)
            await self._record_finished_stops(among)
            await self._plan_admitted()
            if among is not None:
                among |= self.state.take_touched()  # what this pass recorded: its plans are started now
            work = self._due_work(among)
        for future in work:
            self._outstanding.add(future)
            future.add_done_callback(self._answered)
        return work

    def _answered(self, future: asyncio.Future[None]) -> None:
        self._outstanding.discard(future)
        if not future.cancelled() and (error := future.exception()) is not None:
            log.error("launch.request_failed", error=repr(error))

    def _confirmed(self, launch: Launch) -> set[str]:
        calls = self._calls.get(launch.job_id)
        return calls.stop_confirmed.get(launch.attempt, set()) if calls is not None else set()

    # --- what is kept of each job's requests ----------------------------------------------------------

    def _calls_of(self, job_id: str) -> JobCalls | None:
        """What is kept of the job's requests, made when first needed; None for a job the state no longer holds
        (archived), whose late answers are let go."""
        calls = self._calls.get(job_id)
        if calls is None and self.state.holds(job_id):
            calls = self._calls[job_id] = JobCalls()
        return calls

    def forget(self, job_id: str) -> None:
        """The job left the state: nothing of its requests is kept."""
        self._calls.pop(job_id, None)

    def _keep_calls_needed(self) -> None:
        """Drop what is kept of the requests of jobs with no launch under way, no attempt to plan and no processes
        given up: a launch that starts again later has its requests sent afresh."""
        fenced = {job_id for job_id, _, _ in self.state.fences}
        self._calls = {job_id: calls for job_id, calls in self._calls.items()
                       if job_id in self.state.unsettled or job_id in self.state.unplanned or job_id in fenced}

    # --- what the answers settled (under the lock) ----------------------------------------------------

    async def _give_up_lost_nodes(self, among: set[str] | None) -> None:
        for launch in self.state.active(among):
            if not self.state.stop_wanted(launch):
                continue
            for node in sorted(self.state.lost_nodes_of(launch) - self._confirmed(launch)):
                await self._give_up_node(launch, node, f"node {node} was lost")

    async def _record_finished_stops(self, among: set[str] | None) -> None:
        for launch in self.state.active(among):
            changes = stopped(self.state, launch, self._confirmed(launch))
            if changes:
                with internal_span("launcher stopped", launch.trace, launch.job_id, attempt=launch.attempt):
                    await self.service.record(changes)

    async def _plan_admitted(self) -> None:
        """Plan each admitted attempt whose nodes chose their ports, or waited long enough for them: all in
        one append, each in a span of its job's trace."""
        now = time.monotonic()
        plans: list[NewEvent] = []
        planned: list[tuple[str, int]] = []
        for job_id, admitted in list(self.state.unplanned.items()):
            key = (job_id, admitted.event.attempt)
            if (calls := self._calls_of(job_id)) is None:
                continue  # never: an attempt to plan is held
            wanted, chosen = needs_ports(self.state, self.cluster, job_id), calls.chosen.get(key[1], {})
            silent = sorted(set(wanted) - set(chosen))
            if silent and now - calls.wanted_since.setdefault(key[1], now) < PORTS_WAIT_SECONDS:
                continue
            if silent:
                log.warning("launch.ports_not_chosen", job_id=job_id, attempt=key[1], nodes=silent,
                            waited_seconds=PORTS_WAIT_SECONDS)
            with internal_span("launcher plan", admitted.trace, job_id, attempt=admitted.event.attempt):
                trace = current_trace_headers()
                plans += [NewEvent(change.aggregate_type, change.aggregate_id, change.event, trace=trace)
                          for change in plan_admission(self.state, self.cluster, job_id, chosen)]
            planned.append(key)
        await self.service.record(plans)
        for job_id, attempt in planned:
            if (calls := self._calls.get(job_id)) is not None:
                calls.chosen.pop(attempt, None)
                calls.wanted_since.pop(attempt, None)

    async def _give_up_node(self, launch: Launch, node: str, reason: str) -> None:
        """Record the node's running processes lost and count it as stopped (the caller holds the lock)."""
        changes = give_up_node(launch, node, reason)
        if changes:
            with internal_span("launcher give up", launch.trace, launch.job_id, attempt=launch.attempt, node=node):
                await self.service.record(changes)
        self._stop_answered(launch, node)

    def _stop_answered(self, launch: Launch, node: str) -> None:
        """The node confirmed the stop of the launch (or was given up on): the launch is looked at again."""
        calls = self._calls_of(launch.job_id)
        if calls is None:
            return  # the job left meanwhile
        calls.stop_confirmed.setdefault(launch.attempt, set()).add(node)
        calls.unanswered_since.pop((launch.attempt, node), None)
        self.state.touched.add(launch.job_id)
        self.service.wake.set()

    # --- what to send ---------------------------------------------------------------------------------

    def _due_work(self, among: set[str] | None) -> list[asyncio.Future[None]]:
        now = time.monotonic()
        work: list[asyncio.Future[None]] = []
        starts: dict[str, list[tuple[Launch, Unit, SendKey]]] = {}  # by node
        for job_id, admitted in self.state.unplanned.items():
            attempt = admitted.event.attempt
            calls = self._calls.get(job_id)
            chosen = calls.chosen.get(attempt, {}) if calls is not None else {}
            for node, count in needs_ports(self.state, self.cluster, job_id).items():
                ports_key: SendKey = ("ports", attempt, node, job_id)
                if node not in chosen and self._due(ports_key, now, PORTS_RESEND_SECONDS):
                    work.append(self._send([ports_key], self._reserve(admitted, node, count)))
        for launch in self.state.active(among):
            if self.state.stop_wanted(launch):
                confirmed = self._confirmed(launch)
                running = {launch.node(unit) for unit in launch.running()}
                for node in set(launch.node_names) - (confirmed - running):
                    key: SendKey = ("stop", launch.attempt, node, launch.job_id)
                    if self._due(key, now):
                        work.append(self._send([key], self._stop(launch, node)))
                continue
            for unit in launch.leftovers():
                node = launch.node(unit)
                key = ("stop-task", launch.attempt, (unit[0], node), launch.job_id)
                if self._due(key, now):
                    work.append(self._send([key], self._stop(launch, node, task=unit[0])))
            for unit in launch.pending():
                key = ("start", launch.attempt, unit, launch.job_id)
                if self._due(key, now):
                    starts.setdefault(launch.node(unit), []).append((launch, unit, key))
        for job_id, attempt, node in sorted(self.state.fences):
            key = ("fence", attempt, node, job_id)
            if self._due(key, now):
                work.append(self._send([key], self._fence(job_id, attempt, node)))
        for node, due in starts.items():  # a node's starts in one request (a few, when they are many)
            for first in range(0, len(due), MAX_STARTS_PER_REQUEST):
                batch = due[first:first + MAX_STARTS_PER_REQUEST]
                work.append(self._send([key for _, _, key in batch],
                                       self._start(node, [(launch, unit) for launch, unit, _ in batch])))
        return work

    def _due(self, key: SendKey, now: float, every: float = RESEND_SECONDS) -> bool:
        # Never twice at once: a stop may take a job's whole graceful shutdown time to be answered.
        calls = self._calls_of(key[3])
        if calls is None or key in self._in_flight or now - calls.sent.get(key, -every) < every:
            return False
        calls.sent[key] = now
        return True

    def _send(self, keys: Sequence[SendKey], request: Awaitable[None]) -> asyncio.Future[None]:
        """`request`, which carries what `keys` name, out until it is answered."""
        self._in_flight.update(keys)

        async def sending() -> None:
            try:
                await request
            finally:
                answered = time.monotonic()
                for key in keys:
                    self._in_flight.discard(key)
                    if (calls := self._calls.get(key[3])) is not None:
                        calls.sent[key] = answered  # the next one is due a while after this answer

        return asyncio.ensure_future(sending())

    # --- the calls (outside the lock) -----------------------------------------------------------------

    async def _ask(self, subject: str, request: ReservePorts | StartProcesses | StopProcesses, *,
                   timeout: float) -> AgentReply:
        """Send a request to an agent; an agent that could not do it answers a CommandError, which counts
        as no answer: the request is sent again, and a stop never answered leads to giving up the node."""
        try:
            reply = await call(self.service.rt.nc, subject, request, timeout=timeout,
                               reply_type=AgentReply | CommandError, signer=self.signer)
        except ServiceUnavailable:
            otel_trace.get_current_span().set_attribute("error.type", "unavailable")
            raise
        if isinstance(reply, CommandError):
            otel_trace.get_current_span().set_attribute("error.type", reply.code)
            raise AgentRefused(f"{subject}: {reply.code}: {reply.message}")
        return cast(AgentReply, reply)

    def _job_token(self, launch: Launch) -> str:
        """The job attempt's own token, for its processes' remote shell: the same for all its nodes, so made
        once (it names every node: made for each start, a job of n nodes would cost n² to start)."""
        calls = self._calls_of(launch.job_id)
        if calls is not None and (token := calls.tokens.get(launch.attempt)) is not None:
            return token
        token = issue_job_token(self.secret, launch.job_id, launch.attempt, launch.node_names,
                                issued_at=int(launch.planned_at.timestamp()))
        if calls is not None:
            calls.tokens[launch.attempt] = token
        return token

    async def _reserve(self, admitted: Admitted, node: str, count: int) -> None:
        """Ask `node` to choose `count` rendezvous ports for the attempt; the answer is kept for its plan."""
        job_id, attempt = admitted.event.job_id, admitted.event.attempt
        request = ReservePorts(job_id=job_id, attempt=attempt, count=count)
        try:
            with send_span(subjects.agent_ports, node, admitted.trace, job_id, attempt=attempt):
                reply = await self._ask(subjects.agent_ports(node), request, timeout=2.0)
        except (ServiceUnavailable, AgentRefused) as exc:
            log.warning(_failure(exc), job_id=job_id, node=node, error=str(exc))
            return
        if not isinstance(reply, PortsReserved) or len(set(reply.ports)) != count:
            log.warning("launch.ports_answer_unusable", job_id=job_id, node=node, reply=str(reply)[:200])
            return
        current = self.state.unplanned.get(job_id)
        if current is None or current.event.attempt != attempt or (calls := self._calls_of(job_id)) is None:
            return  # planned (or the job left) meanwhile: a late answer is kept by no one
        calls.chosen.setdefault(attempt, {})[node] = list(reply.ports)
        self.service.wake.set()

    async def _start(self, node: str, due: Sequence[tuple[Launch, Unit]]) -> None:
        """Send the starts due for `node` in one request (a few, to keep each under half the largest a request may
        be), each start in a client span of its job's trace, which it carries to the agent."""
        with ExitStack() as spans:
            items: list[TracedStart] = []
            opened: list[otel_trace.Span] = []
            for launch, unit in due:
                launched = launch.plan.launch(unit)
                opened.append(spans.enter_context(send_span(
                    subjects.agent_starts, node, launch.trace, launch.job_id, attempt=launch.attempt,
                    task=launched.task, rank=launched.rank)))
                items.append(TracedStart(start=StartProcess(job_id=launch.job_id, attempt=launch.attempt,
                                                            launch=launched, job_token=self._job_token(launch)),
                                         trace=current_trace_headers()))
            await asyncio.gather(*(self._ask_starts(node, [items[i] for i in part], [opened[i] for i in part])
                                   for part in _parts_by_size(items, MAX_REQUEST_BYTES // 2)))

    async def _ask_starts(self, node: str, items: list[TracedStart], spans: list[otel_trace.Span]) -> None:
        # The request itself is in no job's trace: each start carries its own, which the agent continues.
        outside = otel_context.attach(otel_context.Context())
        try:
            reply = await self._ask(subjects.agent_starts(node), StartProcesses(starts=items), timeout=5.0)
            if not isinstance(reply, StartsAnswered) or len(reply.answers) != len(items):
                raise AgentRefused(f"{subjects.agent_starts(node)}: not an answer to each start: {str(reply)[:200]}")
        except (ServiceUnavailable, AgentRefused) as exc:
            for item, span in zip(items, spans, strict=True):
                span.set_attribute("error.type", "unavailable" if isinstance(exc, ServiceUnavailable) else "refused")
                with otel_trace.use_span(span):  # logged in the start's trace
                    log.warning(_failure(exc), job_id=item.start.job_id, node=node, error=str(exc))
            return
        finally:
            otel_context.detach(outside)
        for item, span, answer in zip(items, spans, reply.answers, strict=True):
            start = item.start
            with otel_trace.use_span(span):
                if isinstance(answer, StartRefused):
                    span.set_attribute("error.type", answer.code)
                    log.warning("launch.agent_refused", job_id=start.job_id, node=node,
                                error=f"{answer.code}: {answer.message}")
                    continue
                log.info("launch.start_sent", job_id=start.job_id, task=start.launch.task, rank=start.launch.rank,
                         node=node)

    async def _stop(self, launch: Launch, node: str, *, task: int | None = None) -> None:
        settings = self.service.rt.settings
        request = stop_request(launch, self.state.spec(launch.job_id), self.state.settings,
                               default_grace=settings.stop_grace_seconds, task=task)
        timeout = reply_timeout(request)
        if task is not None:  # ending one finished task's helpers; the launch goes on
            sending = send_span(subjects.agent_stop, node, launch.trace, launch.job_id, attempt=launch.attempt,
                                task=task)
            with suppress(ServiceUnavailable, AgentRefused), sending:
                await self._ask(subjects.agent_stop(node), request, timeout=timeout)
            return
        try:
            with send_span(subjects.agent_stop, node, launch.trace, launch.job_id, attempt=launch.attempt):
                await self._ask(subjects.agent_stop(node), request, timeout=timeout)
            self._stop_answered(launch, node)
            log.info("launch.stop_confirmed", job_id=launch.job_id, node=node)
        except (ServiceUnavailable, AgentRefused) as exc:
            log.warning(_failure(exc), job_id=launch.job_id, node=node, error=str(exc))
            if (calls := self._calls_of(launch.job_id)) is None:
                return  # the job left meanwhile: nothing is given up for it
            since = calls.unanswered_since.setdefault((launch.attempt, node), time.monotonic())
            if time.monotonic() - since >= settings.stop_give_up_seconds:
                async with self.service.lock:
                    await self._give_up_node(launch, node, f"node {node} did not answer stop requests for "
                                                           f"{settings.stop_give_up_seconds:g}s")

    async def _fence(self, job_id: str, attempt: int, node: str) -> None:
        """Ask a node whose processes of `attempt` were given up to end them, at once and without a checkpoint
        (the next attempt may already write one); asked again until the node answers."""
        request = StopProcesses(job_id=job_id, attempt=attempt, grace_seconds=0)
        launch = self.state.launches.get(job_id)
        try:
            with send_span(subjects.agent_stop, node, launch.trace if launch else None, job_id, attempt=attempt):
                await self._ask(subjects.agent_stop(node), request, timeout=5.0)
        except (ServiceUnavailable, AgentRefused):
            return  # still away: asked again later
        async with self.service.lock:
            if (job_id, attempt, node) in self.state.fences:
                log.info("launch.given_up_processes_stopped", job_id=job_id, attempt=attempt, node=node)
                await self.service.record(fenced(job_id, attempt, node))


def _parts_by_size(items: Sequence[msgspec.Struct], limit: int) -> list[list[int]]:
    """The indexes of `items` in consecutive parts whose encoded sizes add up to `limit` at most (an item larger
    than that alone in its part)."""
    parts: list[list[int]] = []
    size = limit
    for index, item in enumerate(items):
        length = len(encode(item))
        if size + length > limit:
            parts.append([])
            size = 0
        parts[-1].append(index)
        size += length
    return parts


def _failure(exc: Exception) -> str:
    """The log event for a request an agent did not carry out."""
    return "launch.agent_refused" if isinstance(exc, AgentRefused) else "launch.agent_unreachable"
