"""The ranks this node runs, from the launcher's start to their report (SPEC L1, J3, J10, J12, J14, J15, M3).

- a start is accepted once: a repeated start of the same (job, attempt, task, rank) is acknowledged without
  starting anything, and a stopped attempt never starts again; a rank is kept while it is prepared and runs,
  and only noted once it ended and was reported (FORGET_SECONDS), so that an agent that runs for months
  holds nothing of the jobs that went through it;
- a rank's datasets are staged (J14) and its image unpacked (J10) first, while a record of the accepted start
  on disk lets a later agent begin it again; then its workspace is built (agent/isolation/workspace.py), its
  environment composed (agent/processes/jobenv.py) and its command handed to the agent's holder
  (agent/processes/holder.py), so that jobs outlive the agent: a restarted agent adopts what the one before
  started;
- its output, start, exit, metrics and usage are shipped as it runs (agent/output/shipper.py);
- a stop sends the attempt's checkpoint signal where asked (agent/processes/signals.py, J12, M3);
- a rank's folder is removed once its process ended, unless its launch keeps it for debug sessions
  (agent/ranks/debugging.py, J15).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from opentelemetry import trace as otel_trace

from agent.caches.datacache import StagingError
from agent.caches.imagecache import ImageCacheError, ImageRoot
from agent.caches.imageprep import ImagePreparation, host_binds, on_agent_python
from agent.caches.preparation import DataPreparation, holder_of
from agent.isolation.workspace import (
    BWRAP,
    RUN_FOLDER,
    WorkspaceError,
    build_workspace,
    job_user,
    jobs_as_root,
)
from agent.output.runs import remove_run_folder, runs_folder
from agent.output.shipper import OutputShipper
from agent.output.tail import OutputTail, append_note
from agent.processes.holder import OUTPUT_NAME
from agent.processes.holder_client import HeldProcess, HolderFailed, HoldServer
from agent.processes.jobenv import job_environment, network_env, passed_on
from agent.processes.signals import Attempt, Leader, parse_signal, send, session_processes, stop_attempt
from agent.ranks.debugging import DebugSessions, remove_rank_folder
from agent.ranks.kept import (
    ENVIRONMENT_NAME,
    SAFE_ID,
    Environment,
    from_recorded,
    job_of_folder,
    node_files,
    rank_of_folder,
    rank_root,
    read_environment,
    recorded,
    write_environment,
)
from agent.ranks.process import (
    ProcessGroup,
    Record,
    read_pending,
    read_records,
    remove_pending,
    remove_record,
    write_pending,
    write_record,
)
from agent.ranks.running_rank import PendingStart, RankKey, RunningNode
from agent.ranks.spread import spread_subfolders
from agent.ranks.tcp_ports import PortBook
from libs.contracts.agent import (
    ExecExited,
    ExecInJob,
    PortsReserved,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    ReservePorts,
    StartProcess,
    Stopped,
    StopProcesses,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode, encode
from libs.contracts.events import Mount, NodeLaunch
from libs.contracts.images import ImageUse
from libs.contracts.operations.base import CommandError
from libs.contracts.runs import RUN_SOCKET_VARIABLE
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer

log = get_logger(__name__)
span_tracer = tracer("trainyard.agent")
# A start is reported once the command has run this long; one that ends sooner has its start reported with its
# exit, so that the launcher records both at once (a sweep's short jobs cost a report and an append less each).
# Half a second: on a busy node a command that does nothing is often seen ended only after a tenth of one (at
# 0.1 s, 44% of 2,000 `true` jobs on two busy cores had their start reported alone). The start keeps its own
# time (`started_at`); only the pid's showing in `show` waits.
START_REPORT_SECONDS = 0.5
# How long a rank that ended (reported, or never started) and an attempt that was stopped stay noted, so that
# a start sent again is answered `already_known` and runs nothing: the launcher sends a start again every few
# seconds until it has folded the rank's report, and a signed request older than a few minutes is refused
# anyway (libs/controlsign.py). An hour covers that many times over; forgetting after it is no worse than a
# restart of the agent, which forgets them all. Nothing of an attempt that still has a rank here is forgotten.
FORGET_SECONDS = 3600.0

Noted = TypeVar("Noted", bound=Hashable)


class RankRunner:
    """Starts, follows, stops and adopts the ranks of jobs on this node."""

    def __init__(self, nc: Client, info: NodeInfo, *, root: Path, storage: Path, nats_url: str, backend: str,
                 hidden_paths: list[Path], ports: PortBook, data: DataPreparation, images: ImagePreparation,
                 output: OutputShipper, debugging: DebugSessions, nodes: dict[RankKey, RunningNode],
                 host_interfaces: Mapping[str, list[str]], clock: Callable[[], float] = time.monotonic) -> None:
        """`backend`: how workspaces are made (SPEC L1), chosen at the agent's start; `hidden_paths`: what jobs
        must not see under bwrap; `nodes`: the ranks on this node (job, attempt, task, rank) while they are
        prepared, run and are reported, which the debug sessions look up too; `host_interfaces`: the host's
        addresses by interface, for the jobs' network; `clock`: seconds, monotonic (port holds, what is
        forgotten when)."""
        self.nc = nc
        self.info = info
        self.root = root
        self.storage = storage
        self.nats_url = nats_url  # what jobs are told to reach NATS at
        self.backend = backend
        self.hidden_paths = hidden_paths
        self.ports = ports  # rendezvous ports chosen here for the launcher (ReservePorts)
        self.data = data
        self.images = images
        self.output = output
        self.debugging = debugging
        self.nodes = nodes
        self.clock = clock
        # Noted when they ended or were stopped, oldest first: a start sent again for them runs nothing, until
        # they are forgotten (FORGET_SECONDS).
        self.ended: dict[RankKey, float] = {}
        self.stopped_attempts: dict[tuple[str, int], float] = {}
        self.holders = HoldServer()  # starts and waits for each rank's command (agent/processes/holder.py)
        self.image_binds = host_binds()
        self.jobs_as_root = jobs_as_root()  # an administrator's setting, read once: fixed while it runs
        # What jobs may take from the agent's environment (agent/processes/jobenv.py), read once: it is fixed
        # while it runs.
        self.job_basics = passed_on(os.environ)
        self.job_network = network_env(self.info.address, host_interfaces)
        self._execs: set[asyncio.Task[None]] = set()  # exec finishers under way

    # --- what the rest of the agent asks of the ranks ---------------------------------------------

    def live_attempts(self) -> set[tuple[str, int]]:
        return {(n.job_id, n.attempt) for n in self.nodes.values() if n.is_running()}

    def running_holders(self) -> list[str]:
        """The holders of the ranks that run, as heartbeats carry them."""
        return [n.holder for n in self.nodes.values() if n.is_running()]

    def release_unused_ports(self) -> None:
        """Free the ports held for attempts that no longer run here."""
        self.ports.release_unused(self.clock(), self.live_attempts())

    def forget_ended(self) -> None:
        """Forget the ranks that ended and the attempts stopped FORGET_SECONDS ago or more, but for attempts
        that still have a rank here."""
        before = self.clock() - FORGET_SECONDS
        if not _noted_before(self.ended, before) and not _noted_before(self.stopped_attempts, before):
            return  # the usual beat: nothing old enough, and no look at every rank
        here = {(n.job_id, n.attempt) for n in self.nodes.values()}
        forget_noted_before(self.ended, before, keep=lambda key: key[:2] in here)
        forget_noted_before(self.stopped_attempts, before, keep=lambda attempt: attempt in here)

    def each_beat(self) -> None:
        """What is due at every heartbeat: ports no attempt here uses freed, ranks long over forgotten."""
        self.release_unused_ports()
        self.forget_ended()

    def job_tokens(self, job_id: str, attempt: int) -> list[str]:
        """The tokens the launcher gave the ranks of this job attempt that run here."""
        return [n.job_token for n in self.nodes.values() if (n.job_id, n.attempt) == (job_id, attempt)
                and n.job_token]

    # --- at the agent's start and close -----------------------------------------------------------

    def spread_job_folders(self) -> None:
        """The folders every job makes subfolders in and removes them from: spread apart where the file system
        can (agent/ranks/spread.py), so that making them stays cheap however many jobs ended lately."""
        jobs, runs = self.root / "jobs", Path(runs_folder())
        jobs.mkdir(parents=True, exist_ok=True)
        runs.mkdir(mode=0o700, parents=True, exist_ok=True)
        spread = [str(folder) for folder in (jobs, runs) if spread_subfolders(folder)]
        log.info("agent.job_folders", node=self.info.name, spread=spread)

    async def keep_pins(self) -> None:
        """Drop the cache pins of ranks that are gone: a dataset stays pinned for the running ranks, an image
        also for the environments kept for debugging (J15)."""
        self.data.keep_pins({node.holder for node in self.nodes.values()})
        kept = {holder_of(job_of_folder(path.parent), *rank) for path in node_files(self.root, ENVIRONMENT_NAME)
                if (rank := rank_of_folder(path.parent)) is not None}
        await asyncio.to_thread(self.images.cache.unpin_all_but, {node.holder for node in self.nodes.values()} | kept)

    async def adopt(self) -> None:
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
                self.ports.hold((record.job_id, record.attempt), [record.port], self.clock())
            log.info("agent.adopted", job_id=record.job_id, attempt=record.attempt, task=record.task,
                     rank=record.rank, node=self.info.name, pid=record.pid, running=held.running)
            self.nodes[key] = node
            if held.running:  # its processes log on into the same socket, made again
                node.relay = self.output.relay(node, folder)
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
                               task=request.launch.task, trace=dict(pending.trace), job_token=request.job_token,
                               imageless=request.launch.image is None)
            log.info("agent.start_resumed", job_id=node.job_id, attempt=node.attempt, task=node.task,
                     rank=node.rank, node=self.info.name)
            self._begin(node, request)

    def leave_running(self) -> None:
        """Stop following the ranks: they run on under their holder, for the next agent to adopt."""
        running = [n for n in self.nodes.values() if n.is_running()]
        for node in running:
            assert node.runner is not None
            node.runner.cancel()  # a shipment cut short here is shipped again by the next agent
        if running:
            log.info("agent.jobs_left_running", node=self.info.name, processes=len(running))
        self.abandon_relays()

    def abandon_relays(self) -> None:
        for node in self.nodes.values():
            if node.relay is not None:
                node.relay.abandon()

    # --- requests from the launcher ---------------------------------------------------------------

    async def reserve_ports(self, request: ReservePorts) -> PortsReserved | CommandError:
        ports = self.ports.reserve((request.job_id, request.attempt), request.count, self.clock(),
                                   self.live_attempts())
        if ports is None:
            return CommandError(code="unavailable",
                                message=f"{self.info.name} has fewer than {request.count} free ports in "
                                        f"{self.ports.low}-{self.ports.high}",
                                hint="widen TRAINYARD_JOB_PORTS on the node, or end what holds its ports")
        log.info("agent.ports_reserved", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                 ports=ports)
        return PortsReserved(ports=ports)

    async def accept_start(self, request: StartProcess) -> ProcessAccepted | CommandError:
        """Begin the rank unless it is known (begun, ended lately, or of an attempt stopped); its reports continue the
        current trace (its request's)."""
        if not SAFE_ID.match(request.job_id):  # it names the node's folder
            return CommandError(code="invalid-request", message=f"{request.job_id!r} is not a job id")
        key = (request.job_id, request.attempt, request.launch.task, request.launch.rank)
        # Ranks that ended stay known a while after they are let go (FORGET_SECONDS), stopped attempts too.
        known = key in self.nodes or key in self.ended or (request.job_id, request.attempt) in self.stopped_attempts
        if not known:
            # The node's reports continue the trace of this request.
            node = RunningNode(job_id=request.job_id, attempt=request.attempt, rank=request.launch.rank,
                               task=request.launch.task, trace=current_trace_headers(), job_token=request.job_token,
                               helper=request.launch.role != "worker", imageless=request.launch.image is None)
            self.nodes[key] = node  # before any wait: a repeated request finds it known
            if _prepares_first(request.launch):  # staging or unpacking takes a while: outlive a crash
                root = rank_root(self.root, node.job_id, node.attempt, node.task, node.rank)
                await asyncio.to_thread(write_pending, root, encode(PendingStart(request=request, trace=node.trace)))
            self._begin(node, request)
        return ProcessAccepted(already_known=known)

    def begin_stop(self, request: StopProcesses) -> Coroutine[Any, Any, Stopped]:
        """Mark the attempt stopped and pick its processes now; the stop itself, which waits until they are gone,
        is what this returns."""
        if request.task is None:
            _note(self.stopped_attempts, (request.job_id, request.attempt), self.clock())
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
        return self._stop(request, attempt, groups, checkpoint, len(targets))

    async def _stop(self, request: StopProcesses, attempt: Attempt, groups: list[Leader],
                    checkpoint: signal.Signals | None, processes: int) -> Stopped:
        if checkpoint is not None:
            log.info("agent.checkpoint_signal", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                     signal=checkpoint.name, grace_seconds=request.grace_seconds)
        signalled = await stop_attempt(attempt, groups, request.grace_seconds, checkpoint)
        log.info("agent.stopped", job_id=request.job_id, attempt=request.attempt, node=self.info.name,
                 processes=processes, checkpoint_signal=request.checkpoint_signal, signalled=signalled)
        return Stopped(stopped=processes)

    async def exec_in_job(self, request: ExecInJob) -> ProcessAccepted | CommandError:
        """Start the command in the job's running environment now; its exit code goes to `reply_to` when it
        ends."""
        node = next((n for n in self.nodes.values()
                     if (n.job_id, n.attempt, n.task) == (request.job_id, request.attempt, request.task)
                     and n.group is not None and n.workspace is not None and n.is_running()), None)
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

    # --- running one node of a job ----------------------------------------------------------------

    def _begin(self, node: RunningNode, request: StartProcess) -> None:
        self.nodes[(node.job_id, node.attempt, node.task, node.rank)] = node
        if request.launch.port:  # reserved here before, unless this agent restarted since
            self.ports.hold((request.job_id, request.attempt), [request.launch.port], self.clock())
        node.runner = asyncio.create_task(self._run(node, request))

    def _let_go(self, node: RunningNode) -> None:
        """The rank is over and reported: nothing of it is kept but a note that it ended (a start sent again
        for it is known)."""
        self.nodes.pop(node.key, None)
        _note(self.ended, node.key, self.clock())

    async def _run(self, node: RunningNode, request: StartProcess) -> None:
        # One span per rank start, a child of the start request's (whose trace the node keeps), until it runs.
        with span_tracer.start_as_current_span("start rank", context=context_from_headers(node.trace), attributes={
                "trainyard.job.id": node.job_id, "trainyard.attempt": node.attempt, "trainyard.task": node.task,
                "trainyard.rank": node.rank, "trainyard.node": self.info.name}):
            started = await self._start_rank(node, request)
        if started is None:  # it never ran, and its exit is reported
            self._let_go(node)
            return
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
        relay = node.relay = self.output.relay(node, root)
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
        for target, owner in workspace.not_writable:
            append_note(root, f"{target} is another user's in shared storage (uid {owner}): this job cannot write "
                              "there; give it a folder of its own (such as another output name)")
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
        # Under bwrap, the sandbox runs argv, the host's files shown through a view its holder makes once.
        view = workspace.host_view()
        command = workspace.command(argv, env.get("PATH"), host_view=view)
        try:
            held = await HeldProcess.start(root, command, env, workspace.cwd, self.holders,
                                           sandbox=workspace.sandbox is not None,
                                           view=view.request if view is not None else None)
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
        shipper = asyncio.create_task(self.output.ship_continuously(node, stop=shipped))
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
        await self.output.ship_continuously(node)
        await self.output.report(ProcessExited(job_id=node.job_id, attempt=node.attempt, rank=node.rank,
                                               task=node.task, node=self.info.name, exit_code=127,
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
        shipper = asyncio.create_task(self.output.ship_continuously(node))
        sampler = asyncio.create_task(self.output.sample_usage(node, held.pid))
        started: asyncio.Task[None] | None = None
        try:
            if start is not None:
                if not node.helper:  # a worker that ends at once has its start reported with its exit
                    await asyncio.wait([exiting], timeout=START_REPORT_SECONDS)
                if not exiting.done():
                    # Whether or not NATS takes the reports and the log right now: a job never waits on its agent.
                    started = asyncio.create_task(self.output.report(start, "started", node))
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
        await self.output.report(ProcessExited(job_id=node.job_id, attempt=node.attempt, rank=node.rank,
                                               task=node.task, node=self.info.name, exit_code=code,
                                               exited_at=exited_at, started=start if started is None else None),
                                 "exited", node)
        remove_record(root)  # reported: nothing left to adopt
        await held.reported()  # nor for its holder to write down
        self.data.release(node.holder)
        if node.relay is not None:  # what the process logged last is published
            await node.relay.close()
        if not node.keep:
            await self._discard(node, root)
        self._let_go(node)

    async def _discard(self, node: RunningNode, root: Path) -> None:
        """Remove a node's folder (never what its links point to), ending the sessions still in it."""
        node.workspace = None  # no new session finds it
        await self.debugging.end_in(root)
        if not node.imageless:
            self.images.release(node.holder)
        remove_run_folder(root)
        try:
            await remove_rank_folder(self.root, root)
        except OSError as exc:  # a folder left behind costs disk, not the job
            log.warning("agent.workspace_not_removed", job_id=node.job_id, attempt=node.attempt, task=node.task,
                        rank=node.rank, node=self.info.name, error=str(exc))


def _note(noted: dict[Noted, float], key: Noted, now: float) -> None:
    """Note `key` at `now`, after every other: the oldest notes are always first."""
    noted.pop(key, None)
    noted[key] = now


def _noted_before(noted: dict[Noted, float], before: float) -> bool:
    """Whether the oldest note is from before `before`."""
    return bool(noted) and next(iter(noted.values())) < before


def forget_noted_before(noted: dict[Noted, float], before: float, keep: Callable[[Noted], bool]) -> None:
    """Drop the notes (oldest first, as `_note` keeps them) from before `before`, but for those to `keep`: only
    the notes old enough and those kept are looked at."""
    old: list[Noted] = []
    for key, when in noted.items():
        if when >= before:
            break
        old.append(key)
    for key in old:
        if not keep(key):
            del noted[key]


def _prepares_first(launch: NodeLaunch) -> bool:
    """Whether a rank's start copies datasets (J14) or unpacks an image (J10) before its command: a while."""
    return launch.image is not None or any(mount.stage for mount in launch.mounts)


async def _nowhere(_: str) -> None:
    """An exec's lines are in the node's output file already, which is shipped as it grows."""
