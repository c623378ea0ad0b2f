"""The node agent: the only Trainyard process on a compute host. It speaks NATS alone.

- registers the host with the monitor and sends heartbeats;
- obeys only the control plane: start/stop requests signed by the launcher, pre-checks, releases and
  debug sessions signed by the monitor, and commands in a job from that job's own processes
  (libs/controlsign.py, agent/requests.py);
- answers start/stop requests from the launcher; a repeated start of the same (job, attempt,
  rank) is acknowledged without starting anything, and a stopped attempt never starts again;
- answers every request, a malformed one with the reason (agent/requests.py);
- runs each node of a job as a process group in its workspace (a bwrap sandbox, or plain folders
  where bwrap cannot run: see agent/workspace.py) under the agent's holder (agent/holder.py), so
  that jobs outlive the agent: a restarted agent adopts what the one before started (agent/held.py);
- ships each node's output to JetStream in numbered chunks, from its output file, and reports start
  and exit as JetStream messages whose ids make retries harmless;
- probes the node's health (agent/health.py) for heartbeats and pre-checks (M1, M2);
- stops a job attempt with its checkpoint signal where asked (agent/signals.py, J12, M3);
- removes a node's folder once its process ended, or keeps it for debug sessions until the job's
  environments are released (agent/kept.py, agent/sessions.py, J15).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry import trace as otel_trace

from agent.datacache import DatasetCache, StagingError
from agent.health import host_addresses, probe, resource_checks
from agent.held import HeldProcess, HolderFailed, HoldServer, OutputTail, append_note
from agent.holder import OUTPUT_NAME
from agent.imagecache import ImageCacheError, ImageRoot
from agent.imageprep import ImagePreparation, host_binds, on_agent_python
from agent.jobenv import job_environment, network_env, passed_on
from agent.kept import (
    ENVIRONMENT_NAME,
    SAFE_ID,
    Environment,
    RemovalRefused,
    from_recorded,
    has_few_entries,
    job_of_folder,
    kept_roots,
    node_files,
    rank_of_folder,
    rank_root,
    read_environment,
    recorded,
    remove_node_root,
    write_environment,
)
from agent.ports import PortBook
from agent.preparation import DataPreparation, holder_of
from agent.process import (
    ProcessGroup,
    Record,
    read_pending,
    read_records,
    remove_pending,
    remove_record,
    write_pending,
    write_record,
)
from agent.requests import Later, Responder, reply_refused, subject_template
from agent.runs import RunRelay, remove_run_folder, runs_folder, socket_path
from agent.seen import remember_across_restarts
from agent.sessions import Session
from agent.signals import Attempt, Leader, parse_signal, send, session_processes, stop_attempt
from agent.spread import spread_subfolders
from agent.usage import GroupSampler, ProcessTree, accelerator_percent, system_values
from agent.workspace import (
    BWRAP,
    PLAIN,
    PLAIN_WARNING,
    RUN_FOLDER,
    Workspace,
    WorkspaceError,
    build_workspace,
    choose_backend,
    job_user,
    jobs_as_root,
)
from libs.auth import AuthError, bearer_headers, bearer_token
from libs.contracts import subjects
from libs.contracts.agent import (
    AnnounceNodes,
    ExecExited,
    ExecInJob,
    Heartbeat,
    LogChunk,
    NodeAccepted,
    OpenSession,
    PortsReserved,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    RegisterNode,
    Released,
    ReleaseWorkspaces,
    ReservePorts,
    SessionOpened,
    StageAccepted,
    StageDataset,
    StartProcess,
    Stopped,
    StopProcesses,
    UsageSample,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode, encode
from libs.contracts.datacache import CacheReport, StagedDataset
from libs.contracts.events import Mount, NodeLaunch
from libs.contracts.health import ComponentHealth
from libs.contracts.images import ImageUse
from libs.contracts.messages import CommandError
from libs.contracts.runs import RUN_SOCKET_VARIABLE, MetricBatch
from libs.controlsign import ControlRole, ControlVerifier
from libs.messaging.connection import NatsLogin, connect
from libs.messaging.rpc import ServiceUnavailable, call, decode_request
from libs.natsroles import job_inbox
from libs.settings import Settings
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import AGENT_PROCESSES, SampledGauge
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer

log = get_logger(__name__)
_processes = SampledGauge(AGENT_PROCESSES)  # set with every heartbeat
span_tracer = tracer("trainyard.agent")
LOG_FLUSH_SECONDS = 0.2  # how often a node's output file is read for lines to ship
# A start is reported once the command has run this long; one that ends sooner has its start reported with its
# exit, so that the launcher records both at once (a sweep's short jobs cost a report and an append less each).
# Half a second: on a busy node a command that does nothing is often seen ended only after a tenth of one (at
# 0.1 s, 44% of 2,000 `true` jobs on two busy cores had their start reported alone). The start keeps its own
# time (`started_at`); only the pid's showing in `show` waits.
START_REPORT_SECONDS = 0.5
# How long a closing agent waits for NATS to take what it still has to send.
CLOSE_DRAIN_SECONDS = 2.0
USAGE_SECONDS = float(os.environ.get("TRAINYARD_USAGE_SECONDS", "2"))
FIRST_SAMPLE_SECONDS = 0.5
# How long closing the agent waits for its debug sessions to report their end.
SESSION_CLOSE_SECONDS = 5.0


class PendingStart(msgspec.Struct, frozen=True, kw_only=True):
    """A start accepted and not begun yet, as kept on disk (agent/process.py write_pending)."""

    request: StartProcess
    trace: dict[str, str] = msgspec.field(default_factory=dict)


@dataclass
class RunningNode:
    job_id: str
    attempt: int
    rank: int
    task: int = 0  # J3: which task of a batch job
    group: HeldProcess | None = None
    runner: asyncio.Task[None] | None = None
    output: OutputTail | None = None  # what of the node's output file is shipped
    output_done: bool = False  # the process ended: ship what is left, then stop
    # The job's trace context from the start request, carried on this node's reports.
    trace: dict[str, str] = field(default_factory=dict)
    # Where and how the node's command runs, for commands run later in the same environment.
    workspace: Workspace | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Commands run in this node's environment on another node's request (MPI daemons).
    execs: list[ProcessGroup] = field(default_factory=list)
    # J15: the node's folder stays after the process ended (debug sessions) until it is released.
    keep: bool = False
    # The job attempt's token from the launcher: only a request carrying it may run a command in this node.
    job_token: str | None = None
    staged: list[StagedDataset] = field(default_factory=list)  # J14: its data preparation
    image: str | None = None  # J10: the image it runs in (NAME:TAG@digest), pinned in the node's cache
    image_unpacked: bool = False  # and whether its start unpacked it
    relay: RunRelay | None = None  # R1: where its processes log their metrics
    # A parameter server or standby: it runs until stopped, and the launcher must know it runs before the
    # workers' exits end their task, so its start is reported at once.
    helper: bool = False

    # Done once the process ended: its shipper wakes at once rather than at its next look.
    _ended: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    @property
    def holder(self) -> str:
        return holder_of(self.job_id, self.attempt, self.task, self.rank)

    def process_ended(self) -> None:
        """Ship what is left of the output now, then stop."""
        self.output_done = True
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    async def pause(self, seconds: float) -> None:
        """Wait `seconds` before looking at the output again, or less once the process ended."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        if not self.output_done:
            await asyncio.wait((self._ended,), timeout=seconds)


class NodeAgent:
    def __init__(self, info: NodeInfo, *, nats_url: str, root: Path, storage: Path, control: ControlVerifier,
                 health_probe_seconds: float | None = None, node_token: str | None = None,
                 ports: PortBook | None = None) -> None:
        """`node_token`: the node credential sent with registration and heartbeats (`python -m agent` requires
        one; without it the monitor refuses the node). It is never passed to jobs. `control` checks that
        requests come from the launcher and the monitor (its keys come with the node credential)."""
        self.info = info
        self.node_token = node_token
        self.control = control
        self.nats_url = nats_url
        self.root = root
        self.storage = storage
        self.health_probe_seconds = (Settings().health_probe_seconds if health_probe_seconds is None
                                     else health_probe_seconds)
        # What jobs must not see under bwrap: the platform's secrets and state, this agent's folder (other
        # jobs' files and kept environments) and the ranks' run sockets (one job logging into another's run).
        self.hidden_paths = [*Settings().hidden_paths, root, Path(runs_folder())]
        self.health: list[ComponentHealth] = []  # the latest probe, sent with every heartbeat
        # Rendezvous ports chosen here for the launcher (ReservePorts).
        self.ports = ports if ports is not None else PortBook.from_environment()
        # J14, D1, D2: datasets copied to this node's disk before a job's command, kept and reused.
        self.data = DataPreparation(DatasetCache.from_environment(root, storage), info.name)
        # J10: images unpacked on this node's disk, kept by the dataset cache's policy.
        self.images = ImagePreparation.from_environment(root, storage, info.name, lambda: self.data.cache.policy)
        self.image_binds = host_binds()
        self.jobs_as_root = jobs_as_root()  # an administrator's setting, read once: fixed while it runs
        self.disk_pressure: str | None = None  # D1: why the node takes no new work, sent with heartbeats
        self.sessions: dict[str, Session] = {}
        self.nodes: dict[tuple[str, int, int, int], RunningNode] = {}  # (job, attempt, task, rank)
        self.backend = PLAIN  # how workspaces are made (SPEC L1): chosen at start
        self.stopped_attempts: set[tuple[str, int]] = set()
        self.heartbeat_seconds = 2.0
        self.nc: Client
        self.js: JetStreamContext
        self._tasks: list[asyncio.Task[Any]] = []
        self._execs: set[asyncio.Task[None]] = set()  # exec finishers under way
        self._announcing: asyncio.Task[None] | None = None  # a registration the monitor asked for
        self.holders = HoldServer()  # starts and waits for each rank's command (agent/holder.py)
        # What jobs may take from the agent's environment (agent/jobenv.py), read once: it is fixed while it runs.
        self.job_basics = passed_on(os.environ)
        self.job_network = network_env(self.info.address, host_addresses())
        self._usage: KeyValue | None = None  # the usage bucket, once looked up
        self._processes = ProcessTree()  # one look at the host's processes serves every rank sampled meanwhile

    async def start(self) -> None:
        try:
            self.backend, reason = await asyncio.to_thread(choose_backend)
        except WorkspaceError as exc:
            raise SystemExit(str(exc)) from None
        log.info("agent.workspace_backend", node=self.info.name, backend=self.backend, reason=reason)
        if self.backend == PLAIN:
            log.warning("agent.jobs_not_sandboxed", node=self.info.name, warning=PLAIN_WARNING)
        # Logged in by its node credential (NATS's auth callout): this node's subjects only, no stream management.
        login = NatsLogin.for_token(self.node_token)
        self.nc = await connect(self.nats_url, f"trainyard-agent-{self.info.name}", login)
        self.js = self.nc.jetstream()
        await asyncio.to_thread(self.data.cache.open)  # partial copies a crash left are removed
        await asyncio.to_thread(self.images.cache.clean_partial)
        await self._adopt()  # before any request: a stop must find the jobs the agent before started
        self._spread_job_folders()
        self.data.keep_pins({node.holder for node in self.nodes.values()})
        # An image stays pinned for its running ranks and for the environments kept for debugging (J15).
        kept = {holder_of(job_of_folder(path.parent), *rank) for path in node_files(self.root, ENVIRONMENT_NAME)
                if (rank := rank_of_folder(path.parent)) is not None}
        await asyncio.to_thread(self.images.cache.unpin_all_but, {node.holder for node in self.nodes.values()} | kept)
        # What the agents before obeyed stays spent, and nothing signed before now is obeyed (agent/seen.py).
        await asyncio.to_thread(remember_across_restarts, self.control, self.root, time.time())
        requests, name = Responder(self.nc, self.info.name), self.info.name
        launcher, monitor = self._signed_by("launcher"), self._signed_by("monitor")
        await requests.serve(subjects.agent_ports(name), ReservePorts, self._on_ports, launcher)
        await requests.serve(subjects.agent_start(name), StartProcess, self._on_start, launcher)
        await requests.serve(subjects.agent_stop(name), StopProcesses, self._on_stop, launcher)
        await requests.serve(subjects.agent_exec(name), ExecInJob, self._on_exec, self._from_the_job)
        await requests.serve(subjects.agent_precheck(name), PrecheckNode, self._on_precheck, monitor)
        await requests.serve(subjects.agent_release(name), ReleaseWorkspaces, self._on_release, monitor)
        await requests.serve(subjects.agent_stage(name), StageDataset, self._on_stage, monitor)
        await requests.serve(subjects.agent_open_session(name), OpenSession, self._on_open_session, monitor)
        self.health = await self._probe()
        await self._register()
        # Registered again whenever the monitor asks (it started anew, or lost what it knew of this node).
        await self.nc.subscribe(subjects.ANNOUNCE_NODES, cb=self._on_announce)
        self._tasks.append(asyncio.create_task(self._heartbeats()))
        self._tasks.append(asyncio.create_task(self._probe_periodically()))
        self._tasks.append(asyncio.create_task(self.data.housekeeping(self._on_disk_pressure)))
        self._tasks.append(asyncio.create_task(self.images.housekeeping()))
        self._tasks.append(asyncio.create_task(self.data.reporting(self._publish_cache)))
        self.data.cache.changed.set()  # a first report: `trainyard cache` lists every node, its disk too
        log.info("agent.ready", node=self.info.name, cpus=self.info.cpus, memory_mib=self.info.memory_mib)

    def _signed_by(self, role: ControlRole) -> Callable[[Msg, object], str | None]:
        def gate(msg: Msg, _: object) -> str | None:
            return self.control.refusal(role, msg.subject, msg.data, msg.headers, time.time())
        return gate

    def _from_the_job(self, msg: Msg, request: ExecInJob) -> str | None:
        """An exec must carry the token the launcher gave that job attempt: one job cannot run commands in another."""
        try:
            token = bearer_token(msg.headers)
        except AuthError as exc:
            return str(exc)
        given = [n.job_token for n in self.nodes.values() if (n.job_id, n.attempt) == (request.job_id, request.attempt)
                 and n.job_token]
        if not any(hmac.compare_digest(token.encode(), known.encode()) for known in given):
            return f"the request does not carry the token of job {request.job_id} attempt {request.attempt}"
        return None

    async def close(self) -> None:
        """Stop serving; the jobs run on under their holder, for the next agent to adopt (an upgrade or a
        restart of the agent does not end them; `python -m agent --end-jobs` does)."""
        for task in self._tasks:
            task.cancel()
        await self._end_sessions(list(self.sessions.values()))
        running = [n for n in self.nodes.values() if n.runner is not None and not n.runner.done()]
        for node in running:
            assert node.runner is not None
            node.runner.cancel()  # a shipment cut short here is shipped again by the next agent
        if running:
            log.info("agent.jobs_left_running", node=self.info.name, processes=len(running))
        self._abandon_relays()
        # NATS may be out of reach (a cut link): the agent goes all the same, as what it did not publish the
        # next one does; drain would wait for it for half a minute.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), timeout=CLOSE_DRAIN_SECONDS)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self._abandon_relays()  # and those of starts handled while the connection drained
        self.ports.close()  # the next agent holds again the ports of the jobs it adopts
        self.holders.close()  # it ends once its commands have
        self.data.cache.close()

    def _abandon_relays(self) -> None:
        for node in self.nodes.values():
            if node.relay is not None:
                node.relay.abandon()

    def _spread_job_folders(self) -> None:
        """The folders every job makes subfolders in and removes them from: spread apart where the file system
        can (agent/spread.py), so that making them stays cheap however many jobs ended lately."""
        jobs, runs = self.root / "jobs", Path(runs_folder())
        jobs.mkdir(parents=True, exist_ok=True)
        runs.mkdir(mode=0o700, parents=True, exist_ok=True)
        spread = [str(folder) for folder in (jobs, runs) if spread_subfolders(folder)]
        log.info("agent.job_folders", node=self.info.name, spread=spread)

    async def _adopt(self) -> None:
        """Take over the nodes the agent before started: they ran on under their holder meanwhile."""
        # Debug sessions of an agent that is gone have no one to speak to any more.
        send(await asyncio.to_thread(session_processes, self.info.name), signal.SIGKILL)
        for folder, record in await asyncio.to_thread(read_records, self.root):
            key = (record.job_id, record.attempt, record.task, record.rank)
            node = RunningNode(job_id=record.job_id, attempt=record.attempt, rank=record.rank, task=record.task,
                               trace=dict(record.trace), job_token=record.job_token, keep=record.keep)
            environment = read_environment(folder) if record.environment is None else from_recorded(record.environment)
            if environment is not None:
                node.workspace, node.env = environment.workspace, environment.env
            held = HeldProcess(folder, record.pid, record.holder, record.holder_since)
            if record.port and held.running:
                self.ports.hold((record.job_id, record.attempt), [record.port], time.monotonic())
            log.info("agent.adopted", job_id=record.job_id, attempt=record.attempt, task=record.task,
                     rank=record.rank, node=self.info.name, pid=record.pid, running=held.running)
            self.nodes[key] = node
            if held.running:  # its processes log on into the same socket, made again
                node.relay = self._relay(node, folder)
                with contextlib.suppress(OSError):
                    await node.relay.start()
            node.runner = asyncio.create_task(self._follow(node, held, folder))
        # Starts accepted before and not begun (their data was being staged): begun again, from the staging.
        for folder, data in await asyncio.to_thread(read_pending, self.root):
            try:
                pending = decode(data, PendingStart)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("agent.pending_start_unreadable", folder=str(folder))
                continue
            request = pending.request
            node = RunningNode(job_id=request.job_id, attempt=request.attempt, rank=request.launch.rank,
                               task=request.launch.task, trace=dict(pending.trace), job_token=request.job_token)
            log.info("agent.start_resumed", job_id=node.job_id, attempt=node.attempt, task=node.task,
                     rank=node.rank, node=self.info.name)
            self._begin(node, request)

    # --- registration and heartbeats --------------------------------------------------------------

    async def _on_announce(self, msg: Msg) -> None:
        asked = decode_request(msg.data, AnnounceNodes, strict=False)
        if isinstance(asked, CommandError):  # nobody to answer: a publish, not a request
            log.warning("agent.bad_announce", node=self.info.name, error=asked.message)
            return
        if asked.nodes and self.info.name not in asked.nodes:
            return
        if self._announcing is None or self._announcing.done():
            log.info("agent.registering_again", node=self.info.name)
            self._announcing = asyncio.create_task(self._register(refusal_ends_agent=False))

    async def _register(self, *, refusal_ends_agent: bool = True) -> None:
        delay = 0.2
        while True:
            try:
                reply = await call(self.nc, subjects.REGISTER_NODE, RegisterNode(node=self.info), timeout=5.0,
                                   reply_type=NodeAccepted | CommandError, token=self.node_token)
            except ServiceUnavailable as exc:  # the monitor is not up yet: keep trying
                log.info("agent.register_retry", node=self.info.name, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if isinstance(reply, CommandError):
                # A refused registration does not fix itself: stop with the monitor's reason (at start; later
                # the agent goes on with its jobs and says so).
                hint = f"; {reply.hint}" if reply.hint else ""
                if refusal_ends_agent:
                    raise SystemExit(f"the monitor refused node {self.info.name}: {reply.message}{hint}")
                log.error("agent.registration_refused", node=self.info.name, error=reply.message, hint=reply.hint)
                return
            self.heartbeat_seconds = reply.heartbeat_seconds
            if reply.cache != self.data.cache.policy:
                self.data.cache.policy = reply.cache
                self.data.wake.set()
            return

    async def _heartbeats(self) -> None:
        while True:
            running = [n.holder for n in self.nodes.values() if n.runner and not n.runner.done()]
            _processes.set(len(running))
            beat = Heartbeat(node=self.info.name, sent_at=datetime.now(UTC), running=running, health=self.health,
                             disk_pressure=self.disk_pressure)
            self.ports.release_unused(time.monotonic(), self._live_attempts())
            with contextlib.suppress(Exception):
                await self.nc.publish(subjects.heartbeat(self.info.name), encode(beat),
                                      headers=bearer_headers(self.node_token))
            await asyncio.sleep(self.heartbeat_seconds)

    async def _on_stage(self, request: StageDataset) -> StageAccepted:
        """D2: a preload: the dataset is copied in the background; the cache reports show how far it is."""
        log.info("agent.preload", node=self.info.name, source=request.source, preload_id=request.preload_id)
        self.data.preload(request)
        return StageAccepted()

    def _relay(self, node: RunningNode, root: Path) -> RunRelay:
        """R1: the socket the rank's processes log their metrics to, relayed to JetStream."""
        async def publish(batch: MetricBatch, msg_id: str) -> None:
            await self._publish(subjects.job_metrics(batch.job_id, self.info.name), encode(batch), msg_id)
        return RunRelay(job_id=node.job_id, attempt=node.attempt, task=node.task, rank=node.rank, node=self.info.name,
                        path=socket_path(root), publish=publish)

    def _on_disk_pressure(self, reason: str | None) -> None:
        if reason is not None and self.disk_pressure is None:
            log.warning("agent.disk_pressure", node=self.info.name, reason=reason)
        elif reason is None and self.disk_pressure is not None:
            log.info("agent.disk_relieved", node=self.info.name)
        self.disk_pressure = reason

    async def _publish_cache(self, report: CacheReport, msg_id: str) -> None:
        await self._publish(subjects.agent_cache(self.info.name), encode(report), msg_id)

    # --- health (M1, M2) --------------------------------------------------------------------------

    async def _probe(self) -> list[ComponentHealth]:
        """A fresh probe of the node, in a thread: nvidia-smi or slow storage never hold up the agent."""
        health = await asyncio.to_thread(probe, self.info, self.storage, self.root,
                                         nvidia_smi=shutil.which("nvidia-smi"))
        before = {c.key: c.healthy for c in self.health}
        for component in health:
            if component.healthy != before.get(component.key, True):
                log.info("agent.health_changed", node=self.info.name, component=str(component))
        return health

    async def _probe_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.health_probe_seconds)
            try:
                self.health = await self._probe()
            except Exception as exc:  # a probe that breaks must not end the heartbeats' source
                log.exception("agent.probe_failed", node=self.info.name, error=repr(exc))

    async def _on_precheck(self, request: PrecheckNode) -> PrecheckReport:
        self.health = await self._probe()
        checks = [*self.health, *await asyncio.to_thread(resource_checks, request, self.info)]
        log.info("agent.prechecked", job_id=request.job_id, node=self.info.name,
                 problems=[str(c) for c in checks if not c.healthy])
        return PrecheckReport(node=self.info.name, checks=checks)

    # --- requests from the launcher ---------------------------------------------------------------

    def _live_attempts(self) -> set[tuple[str, int]]:
        return {(n.job_id, n.attempt) for n in self.nodes.values() if n.runner is not None and not n.runner.done()}

    async def _on_ports(self, request: ReservePorts) -> PortsReserved | CommandError:
        ports = self.ports.reserve((request.job_id, request.attempt), request.count, time.monotonic(),
                                   self._live_attempts())
        if ports is None:
            return CommandError(code="unavailable",
                                message=f"{self.info.name} has fewer than {request.count} free ports in "
                                        f"{self.ports.low}-{self.ports.high}",
                                hint="widen TRAINYARD_JOB_PORTS on the node, or end what holds its ports")
        log.info("agent.ports_reserved", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                 ports=ports)
        return PortsReserved(ports=ports)

    async def _on_start(self, request: StartProcess) -> ProcessAccepted | CommandError:
        if not SAFE_ID.match(request.job_id):  # it names the node's folder
            return CommandError(code="invalid-request", message=f"{request.job_id!r} is not a job id")
        key = (request.job_id, request.attempt, request.launch.task, request.launch.rank)
        known = key in self.nodes or (request.job_id, request.attempt) in self.stopped_attempts
        if not known:
            # The node's reports continue the trace of this request.
            node = RunningNode(job_id=request.job_id, attempt=request.attempt, rank=request.launch.rank,
                               task=request.launch.task, trace=current_trace_headers(), job_token=request.job_token,
                               helper=request.launch.role != "worker")
            self.nodes[key] = node  # before any wait: a repeated request finds it known
            if _prepares_first(request.launch):  # staging or unpacking takes a while: outlive a crash
                root = rank_root(self.root, node.job_id, node.attempt, node.task, node.rank)
                await asyncio.to_thread(write_pending, root, encode(PendingStart(request=request, trace=node.trace)))
            self._begin(node, request)
        return ProcessAccepted(already_known=known)

    async def _on_stop(self, request: StopProcesses) -> Later:
        if request.task is None:
            self.stopped_attempts.add((request.job_id, request.attempt))
        targets = [n for n in self.nodes.values()
                   if (n.job_id, n.attempt) == (request.job_id, request.attempt) and n.group is not None
                   and request.task in (None, n.task)]
        groups: list[Leader] = [g for n in targets for g in (n.group, *n.execs) if g is not None]
        checkpoint = None
        if request.checkpoint_signal:
            try:
                checkpoint = parse_signal(request.checkpoint_signal)
            except ValueError as exc:  # still stop the job, as a plain stop
                log.warning("agent.bad_checkpoint_signal", job_id=request.job_id, error=str(exc))
        attempt = Attempt(request.job_id, request.attempt, self.info.name, request.task)
        # A job's long graceful shutdown must not hold up the stops of other jobs on this node: the
        # reply comes once the processes are gone, while other requests are answered.
        return Later(self._stop(request, attempt, groups, checkpoint, len(targets)))

    async def _stop(self, request: StopProcesses, attempt: Attempt, groups: list[Leader],
                    checkpoint: signal.Signals | None, processes: int) -> Stopped:
        if checkpoint is not None:
            log.info("agent.checkpoint_signal", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                     signal=checkpoint.name, grace_seconds=request.grace_seconds)
        signalled = await stop_attempt(attempt, groups, request.grace_seconds, checkpoint)
        log.info("agent.stopped", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                 processes=processes, checkpoint_signal=request.checkpoint_signal, signalled=signalled)
        return Stopped(stopped=processes)

    async def _on_exec(self, request: ExecInJob) -> ProcessAccepted | CommandError:
        """Start the command now and answer; its exit code goes to `reply_to` when it ends."""
        if not request.reply_to.startswith(job_inbox(request.job_id) + "."):
            # Only the job's own inbox: a request cannot make the agent publish anywhere else.
            reply_refused(self.info.name, subject_template(subjects.agent_exec(self.info.name), self.info.name),
                          request.job_id, request.reply_to, "the exit's reply_to is not under the job's inbox")
            return CommandError(code="invalid-request", message=f"reply_to must be under {job_inbox(request.job_id)}.")
        node = next((n for n in self.nodes.values()
                     if (n.job_id, n.attempt, n.task) == (request.job_id, request.attempt, request.task)
                     and n.group is not None and n.workspace is not None and n.runner and not n.runner.done()), None)
        if node is None or node.workspace is None:
            return CommandError(code="not-found", message=f"job {request.job_id} attempt {request.attempt} "
                                                          f"does not run on {self.info.name}")
        argv = node.workspace.command(["/bin/sh", "-c", request.command])
        # Its output joins the node's (OpenMPI's daemons print for the ranks they start).
        group = ProcessGroup(argv, node.env, node.workspace.cwd, node.workspace.root / OUTPUT_NAME)
        try:
            await group.start()
        except OSError as exc:
            return CommandError(code="internal", message=f"cannot start the command: {exc}")
        node.execs.append(group)  # a stop of the job reaches it too
        log.info("agent.exec_started", job_id=request.job_id, pid=group.pid)
        task = asyncio.create_task(self._finish_exec(node, group, request.reply_to))
        self._execs.add(task)
        task.add_done_callback(self._execs.discard)
        return ProcessAccepted(already_known=False)

    async def _finish_exec(self, node: RunningNode, group: ProcessGroup, reply_to: str) -> None:
        code = await group.pump(_nowhere)
        node.execs.remove(group)
        with contextlib.suppress(Exception):
            await self.nc.publish(reply_to, encode(ExecExited(exit_code=code)))

    # --- kept environments and debug sessions (J15) -----------------------------------------------

    def _environment(self, job_id: str, attempt: int, task: int, rank: int) -> tuple[Environment, Path] | None:
        """A running node's environment, or one kept on disk (also by an agent that ran before)."""
        node = self.nodes.get((job_id, attempt, task, rank))
        if node is not None and node.workspace is not None and node.runner is not None and not node.runner.done():
            return Environment(workspace=node.workspace, env=node.env), node.workspace.root
        directory = rank_root(self.root, job_id, attempt, task, rank)
        kept = read_environment(directory)
        return None if kept is None else (kept, directory)

    async def _on_open_session(self, request: OpenSession) -> SessionOpened | CommandError:
        """Start a debug session and answer; the session then lives on its own subjects until it ends."""
        bound = log.bind(job_id=request.job_id, attempt=request.attempt, task=request.task, rank=request.rank,
                         node=self.info.name, session_id=request.session_id)
        if not (SAFE_ID.match(request.session_id) and SAFE_ID.match(request.job_id) and SAFE_ID.match(request.owner)):
            return CommandError(code="invalid-request",
                                message="the session's owner and the session and job ids are letters, digits, '-' "
                                        "and '_' only; a session has an owner")
        if request.session_id in self.sessions:
            return CommandError(code="conflict",
                                message=f"session {request.session_id} is already open on {self.info.name}")
        found = self._environment(request.job_id, request.attempt, request.task, request.rank)
        if found is None:
            bound.info("agent.session_refused")
            return CommandError(
                code="not-found",
                message=f"no environment of job {request.job_id} attempt {request.attempt} task {request.task} "
                        f"rank {request.rank} on {self.info.name}: it does not run here, and was not kept or "
                        "was already released",
                hint="open a terminal while the job runs, or within the retention time of a job that keeps its "
                     "environment (debug terminal)")
        environment, directory = found
        session = Session(self.nc, self.info.name, request, environment, directory)
        try:
            pid = await session.start()
        except OSError as exc:
            bound.warning("agent.session_not_started", error=str(exc))
            return CommandError(code="internal", message=f"cannot start the session: {exc}")
        self.sessions[request.session_id] = session
        assert session.done is not None
        session.done.add_done_callback(lambda _: self.sessions.pop(request.session_id, None))
        return SessionOpened(session_id=request.session_id, pid=pid)

    async def _end_sessions(self, sessions: list[Session]) -> None:
        for session in sessions:
            session.kill()
        done = [s.done for s in sessions if s.done is not None]
        if done:
            await asyncio.wait(done, timeout=SESSION_CLOSE_SECONDS)

    async def _on_release(self, request: ReleaseWorkspaces) -> Released | CommandError:
        if not SAFE_ID.match(request.job_id):
            return CommandError(code="invalid-request", message=f"{request.job_id!r} is not a job id")
        running = [n for n in self.nodes.values() if n.job_id == request.job_id and n.workspace is not None
                   and n.runner is not None and not n.runner.done()]
        for node in running:
            node.keep = False  # its folder goes when its process ends
        in_use = {n.workspace.root for n in running if n.workspace is not None}
        removed = 0
        for directory in kept_roots(self.root, request.job_id):
            if directory in in_use:
                continue
            await self._end_sessions([s for s in self.sessions.values() if s.directory == directory])
            if (rank := rank_of_folder(directory)) is not None:
                self.images.release(holder_of(request.job_id, *rank))
            remove_run_folder(directory)
            try:
                await self._remove_node_root(directory)
            except (RemovalRefused, OSError) as exc:
                log.warning("agent.workspace_not_removed", job_id=request.job_id, node=self.info.name,
                            folder=str(directory), error=str(exc))
                continue
            removed += 1
        log.info("agent.workspaces_released", job_id=request.job_id, node=self.info.name, removed=removed)
        return Released(removed=removed)

    # --- running one node of a job ----------------------------------------------------------------

    def _begin(self, node: RunningNode, request: StartProcess) -> None:
        self.nodes[(node.job_id, node.attempt, node.task, node.rank)] = node
        if request.launch.port:  # reserved here before, unless this agent restarted since
            self.ports.hold((request.job_id, request.attempt), [request.launch.port], time.monotonic())
        node.runner = asyncio.create_task(self._run(node, request))

    async def _run(self, node: RunningNode, request: StartProcess) -> None:
        # One span per rank start, a child of the start request's (whose trace the node keeps), until it runs.
        with span_tracer.start_as_current_span("start rank", context=context_from_headers(node.trace), attributes={
                "trainyard.job.id": node.job_id, "trainyard.attempt": node.attempt, "trainyard.task": node.task,
                "trainyard.rank": node.rank, "trainyard.node": self.info.name}):
            started = await self._start_rank(node, request)
        if started is not None:
            await self._follow(node, *started)

    async def _start_rank(self, node: RunningNode, request: StartProcess) -> tuple[HeldProcess, Path] | None:
        """Prepare the rank's workspace and start its command: the process and its folder (None: it never ran)."""
        launch = request.launch
        root = rank_root(self.root, node.job_id, node.attempt, node.task, node.rank)
        staged: dict[str, Path] = {}
        if any(mount.stage for mount in launch.mounts):  # a pending start is kept on disk meanwhile
            prepared = await self._prepare_data(node, root, launch.mounts)
            if prepared is None:
                return None
            staged = prepared
        image: ImageRoot | None = None
        if launch.image is not None:
            image = await self._prepare_image(node, root, launch.image)
            if image is None:
                return None
        relay = node.relay = self._relay(node, root)
        run_as = job_user(launch, node.job_id, as_root=self.jobs_as_root)
        try:
            await relay.start()
            workspace, files = build_workspace(root, self.storage, launch, self.backend, self.hidden_paths,
                                               staged=staged, run_folder=relay.path.parent, image=image,
                                               host_binds=self.image_binds, run_as=run_as)
        except (WorkspaceError, OSError) as exc:
            await self._not_started(node, root, f"cannot prepare the workspace: {exc}")
            await self._discard(node, root)  # half a workspace is nothing to debug in
            return None
        env = job_environment(
            self.job_basics, {k: workspace.translate(v, files) for k, v in launch.env.items()},
            {"TRAINYARD_JOB_ID": node.job_id, "TRAINYARD_ATTEMPT": str(node.attempt),
             "TRAINYARD_TASK": str(node.task), "TRAINYARD_RANK": str(node.rank), "TRAINYARD_NODE": self.info.name,
             "TRAINYARD_WORKSPACE": str(workspace.path), "TRAINYARD_WORKSPACE_BACKEND": workspace.backend,
             RUN_SOCKET_VARIABLE: f"{RUN_FOLDER}/{relay.path.name}" if workspace.backend == BWRAP else str(relay.path)},
            python_dir=Path(sys.executable).parent, nats_url=self.nats_url, job_token=request.job_token,
            network=self.job_network, image_env=image.env if image is not None else None)
        if workspace.sandbox is not None and workspace.sandbox.run_as is not None:
            env["HOME"] = "/tmp"  # its own: the agent's home is neither shown nor the job user's
        argv = [workspace.translate(arg, files) for arg in launch.argv]
        if image is not None:
            argv, env = on_agent_python(argv, env, sys.executable)
        node.workspace, node.env, node.keep = workspace, env, launch.keep_workspace
        environment = Environment(workspace=workspace, env=env)
        if node.keep:  # written first: a session may be wanted however the command ends, even never started
            write_environment(root, job_id=node.job_id, attempt=node.attempt, task=node.task, rank=node.rank,
                              node=self.info.name, environment=environment)
        command = workspace.command(argv, env.get("PATH"))  # under bwrap, the sandbox runs argv
        try:
            held = await HeldProcess.start(root, command, env, workspace.cwd, self.holders)
        except (HolderFailed, OSError) as exc:
            await self._not_started(node, root, f"cannot start {command[0]!r}: {exc}")
            if not node.keep:
                await self._discard(node, root)
            return None
        if _prepares_first(launch):
            remove_pending(root)  # started, or known never to
        if held.started:
            write_record(root, Record(job_id=node.job_id, attempt=node.attempt, task=node.task, rank=node.rank,
                                      pid=held.pid, holder=held.holder_pid, holder_since=held.holder_since,
                                      keep=node.keep, job_token=node.job_token, trace=node.trace,
                                      port=launch.port, environment=recorded(environment)))
            log.info("agent.process_started", job_id=node.job_id, attempt=node.attempt, task=node.task,
                     rank=node.rank, node=self.info.name, pid=held.pid, argv=argv, backend=workspace.backend)
        return held, root

    async def _prepare_data(self, node: RunningNode, root: Path, mounts: list[Mount]) -> dict[str, Path] | None:
        """J14: the node's datasets staged into the cache, the lines saying so shipped as they come; None when
        the command is not to start (the staging failed, or the attempt was stopped meanwhile)."""
        node.output = OutputTail(root)
        # Stopped by asking, not by cancelling: nats-py swallows a cancellation that lands inside a publish.
        shipped = asyncio.Event()
        shipper = asyncio.create_task(self._ship_continuously(node, stop=shipped))
        node_fault = False
        try:
            local, node.staged = await self.data.prepare(mounts, node.holder, root)
            reason = ("stopped during data preparation" if (node.job_id, node.attempt) in self.stopped_attempts
                      else None)
        except StagingError as exc:
            local, reason = {}, f"data preparation failed on node {self.info.name}: {exc}"
            node_fault = exc.node_fault
        finally:
            shipped.set()
            await shipper  # what is on its way is shipped; the rest goes with the next shipper
        if reason is None:
            return local
        log.warning("agent.data_preparation_failed", job_id=node.job_id, attempt=node.attempt, rank=node.rank,
                    node=self.info.name, reason=reason)
        await self._not_started(node, root, reason, node_fault=node_fault)
        await self._discard(node, root)
        return None

    async def _prepare_image(self, node: RunningNode, root: Path, image: ImageUse) -> ImageRoot | None:
        """J10: the job's image unpacked into the node's cache (or found there) and pinned; None when the command
        is not to start (it cannot be, or the attempt was stopped meanwhile)."""
        node_fault = False
        reason: str | None = None
        try:
            found = await self.images.prepare(image, node.holder, root)
            node.image, node.image_unpacked = f"{image.ref}@{image.digest}", found.cold
            if (node.job_id, node.attempt) in self.stopped_attempts:
                reason = "stopped while its image was prepared"
        except ImageCacheError as exc:
            reason, node_fault = f"image {image.ref} cannot be prepared on node {self.info.name}: {exc}", exc.node_fault
        if reason is None:
            return found
        log.warning("agent.image_failed", job_id=node.job_id, attempt=node.attempt, rank=node.rank,
                    node=self.info.name, image=image.ref, reason=reason)
        await self._not_started(node, root, reason, node_fault=node_fault)
        await self._discard(node, root)
        return None

    async def _not_started(self, node: RunningNode, root: Path, reason: str, *, node_fault: bool = False) -> None:
        """The node's command never ran: its output says why, and it exits 127 without a start (saying the
        node is at fault, when it is, so that the job is tried elsewhere). Its copies and socket go with it."""
        otel_trace.get_current_span().set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, reason[:200]))
        self.data.release(node.holder)
        if node.relay is not None:
            await node.relay.close()
        root.mkdir(parents=True, exist_ok=True)
        remove_pending(root)
        append_note(root, reason)
        node.output = OutputTail(root)
        node.process_ended()
        await self._ship_continuously(node)
        await self._report(ProcessExited(job_id=node.job_id, attempt=node.attempt, rank=node.rank, task=node.task,
                                         node=self.info.name, exit_code=127,
                                         node_fault=reason[:1000] if node_fault else None,
                                         not_started=None if node_fault else reason[:1000]), "exited", node)

    async def _follow(self, node: RunningNode, held: HeldProcess, root: Path) -> None:
        """Ship the node's output and report its start and exit, whichever agent started it."""
        node.group, node.output = held, OutputTail(root)
        start = ProcessStarted(job_id=node.job_id, attempt=node.attempt, rank=node.rank, task=node.task,
                               node=self.info.name, pid=held.pid, staged=node.staged,
                               backend=node.workspace.backend if node.workspace else self.backend, image=node.image,
                               image_unpacked=node.image_unpacked, started_at=held.started_at) if held.started else None
        exiting = asyncio.create_task(held.wait_exit())
        shipper = asyncio.create_task(self._ship_continuously(node))
        sampler = asyncio.create_task(self._sample_usage(node, held.pid))
        started: asyncio.Task[None] | None = None
        try:
            if start is not None:
                if not node.helper:  # a worker that ends at once has its start reported with its exit
                    await asyncio.wait([exiting], timeout=START_REPORT_SECONDS)
                if not exiting.done():
                    # Whether or not NATS takes the reports and the log right now: a job never waits on its agent.
                    started = asyncio.create_task(self._report(start, "started", node))
            code, exited_at = await exiting
            node.process_ended()
            await shipper
            if started is not None:
                await started  # the start is reported before the exit
        finally:
            for task in (exiting, started, shipper, sampler):
                if task is not None:
                    task.cancel()
        log.info("agent.process_exited", job_id=node.job_id, attempt=node.attempt, task=node.task, rank=node.rank,
                 node=self.info.name, exit_code=code)
        await self._report(ProcessExited(job_id=node.job_id, attempt=node.attempt, rank=node.rank, task=node.task,
                                         node=self.info.name, exit_code=code, exited_at=exited_at,
                                         started=start if started is None else None), "exited", node)
        remove_record(root)  # reported: nothing left to adopt
        await held.reported()  # nor for its holder to write down
        self.data.release(node.holder)
        if node.relay is not None:  # what the process logged last is published
            await node.relay.close()
        if not node.keep:
            await self._discard(node, root)

    async def _discard(self, node: RunningNode, root: Path) -> None:
        """Remove a node's folder (never what its links point to), ending the sessions still in it."""
        node.workspace = None  # no new session finds it
        await self._end_sessions([s for s in self.sessions.values() if s.directory == root])
        self.images.release(node.holder)
        remove_run_folder(root)
        try:
            await self._remove_node_root(root)
        except OSError as exc:  # a folder left behind costs disk, not the job
            log.warning("agent.workspace_not_removed", job_id=node.job_id, attempt=node.attempt, task=node.task,
                        rank=node.rank, node=self.info.name, error=str(exc))

    async def _remove_node_root(self, directory: Path) -> None:
        """Remove a node folder: on the loop when it is small (most are), else in a worker thread."""
        if has_few_entries(directory):
            remove_node_root(self.root, directory)
        else:
            await asyncio.to_thread(remove_node_root, self.root, directory)

    async def _sample_usage(self, node: RunningNode, pid: int) -> None:
        """Keep the node's latest usage in the usage bucket while it runs (L9)."""
        if pid <= 0:
            return
        sampler = GroupSampler(pid, self._processes)
        key = subjects.usage_key(node.job_id, node.attempt, node.rank, self.info.name)
        pause = min(USAGE_SECONDS, FIRST_SAMPLE_SECONDS)
        while True:
            # A sample costs a scan of every process on the host: a job that ends within FIRST_SAMPLE_SECONDS
            # has none (the first measures the CPU since each process started, the next since the one before).
            await asyncio.sleep(pause)
            pause = USAGE_SECONDS
            cpu, memory_mib, processes = await asyncio.to_thread(sampler.sample)
            boards = await asyncio.to_thread(accelerator_percent) if self.info.accelerators else None
            sample = UsageSample(job_id=node.job_id, attempt=node.attempt, rank=node.rank, node=self.info.name,
                                 cpu_percent=cpu, memory_mib=memory_mib, processes=processes,
                                 sampled_at=datetime.now(UTC), accelerator_percent=boards)
            if node.relay is not None:  # R1: the rank's system series in its run
                node.relay.system(system_values(sample), sample.sampled_at)
            with contextlib.suppress(Exception):  # usage is best effort; the job goes on without it
                if self._usage is None:
                    self._usage = await self.js.key_value(subjects.USAGE_BUCKET)
                await self._usage.put(key, encode(sample))

    async def _ship_continuously(self, node: RunningNode, stop: asyncio.Event | None = None) -> None:
        """Ship the node's output file as it grows, a chunk at a time, in order; once the process ended,
        what is left (a last line without its newline too), then stop. The file is the buffer: the process
        writes on while a shipment waits for NATS, and a later agent ships what this one could not. With
        `stop`: once it is set, end after the chunk on its way (the next shipper takes the rest)."""
        assert node.output is not None
        while not (stop is not None and stop.is_set()):
            final = node.output_done  # read before the file: nothing is written after the exit is known
            # Read in a thread, unless there is nothing to read (one look at the file's size).
            taken = await asyncio.to_thread(node.output.take, final=final) if node.output.waiting() else None
            if taken is None:
                if final:
                    return
                await node.pause(LOG_FLUSH_SECONDS)
                continue
            seq, lines = taken
            chunk = LogChunk(job_id=node.job_id, attempt=node.attempt, rank=node.rank, task=node.task,
                             node=self.info.name, seq=seq, lines=lines)
            msg_id = f"{node.job_id}.{node.attempt}.{node.task}.{node.rank}.log.{seq}"
            await self._publish(subjects.node_logs(node.job_id, node.rank, self.info.name), encode(chunk), msg_id)
            await asyncio.to_thread(node.output.shipped)

    async def _report(self, report: ProcessStarted | ProcessExited, kind: str, node: RunningNode) -> None:
        msg_id = f"{node.job_id}.{node.attempt}.{node.task}.{node.rank}.{kind}"
        await self._publish(subjects.agent_report(self.info.name), encode(report), msg_id, node.trace)

    async def _publish(self, subject: str, payload: bytes, msg_id: str, trace: dict[str, str] | None = None) -> None:
        """Publish to JetStream until it acknowledges; the message id makes repeats harmless."""
        delay = 0.1
        while True:
            try:
                await self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id, **(trace or {})})
                return
            except Exception as exc:  # JetStream unavailable or timed out: try again
                if self.nc.is_closed:  # the agent closed: what it did not publish, the next one does
                    raise
                log.warning("agent.publish_retry", subject=subject, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


def _prepares_first(launch: NodeLaunch) -> bool:
    """Whether a rank's start copies datasets (J14) or unpacks an image (J10) before its command: a while."""
    return launch.image is not None or any(mount.stage for mount in launch.mounts)


async def _nowhere(_: str) -> None:
    """An exec's lines are in the node's output file already, which is shipped as it grows."""
