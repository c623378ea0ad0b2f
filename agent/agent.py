"""The node agent: the only Trainyard process on a compute host. It speaks NATS alone.

`NodeAgent` wires the agent's parts together and routes the control plane's requests to them:

- its presence at the monitor (agent/presence/): registration, heartbeats with health probes (M1, M2) and
  pre-checks;
- the ranks it runs (agent/ranks/): started, followed, stopped with their checkpoint signal (J12, M3) and
  adopted by the next agent, in workspaces (agent/isolation/) under the agent's holder (agent/processes/), so
  that jobs outlive the agent; their folders kept for debug sessions until released (J15);
- what leaves the node for them (agent/output/): output in numbered chunks, start and exit reports, metrics
  and usage, as JetStream messages whose ids make retries harmless;
- the node's caches of datasets and images (agent/caches/, J14, J10, D1, D2).

It obeys only the control plane: start/stop requests signed by the launcher, pre-checks, releases, preloads
and debug sessions signed by the monitor, and commands in a job from that job's own processes
(libs/controlsign.py, agent/requests.py); it answers every request, a malformed one with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.caches.datacache import DatasetCache
from agent.caches.imageprep import ImagePreparation
from agent.caches.preparation import DataPreparation
from agent.isolation.workspace import PLAIN, PLAIN_WARNING, WorkspaceError, choose_backend
from agent.output.runs import runs_folder
from agent.output.shipper import OutputShipper
from agent.presence.health import host_addresses
from agent.presence.node_presence import NodePresence
from agent.ranks.debugging import DebugSessions
from agent.ranks.runner import RankRunner
from agent.ranks.running_rank import RankKey, RunningNode
from agent.ranks.tcp_ports import PortBook
from agent.requests import RequestServer
from agent.seen import remember_across_restarts
from libs.auth import AuthError, bearer_token
from libs.contracts.agent import (
    ExecInJob,
    OpenSession,
    PortsReserved,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    Released,
    ReleaseWorkspaces,
    ReservePorts,
    SessionOpened,
    StageAccepted,
    StageDataset,
    StartProcess,
    StartProcesses,
    StartRefused,
    StartsAnswered,
    StopProcesses,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.operations import agents
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlRole, ControlVerifier
from libs.messaging.connection import NatsLogin, connect
from libs.messaging.responder import Later
from libs.natsroles import job_inbox
from libs.settings import Settings
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
# How long a closing agent waits for NATS to take what it still has to send.
CLOSE_DRAIN_SECONDS = 2.0


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
        # Rendezvous ports chosen here for the launcher (ReservePorts).
        self.ports = ports if ports is not None else PortBook.from_environment()
        # J14, D1, D2: datasets copied to this node's disk before a job's command, kept and reused.
        self.data = DataPreparation(DatasetCache.from_environment(root, storage), info.name)
        # J10: images unpacked on this node's disk, kept by the dataset cache's policy.
        self.images = ImagePreparation.from_environment(root, storage, info.name, lambda: self.data.cache.policy)
        self.backend = PLAIN  # how workspaces are made (SPEC L1): chosen at start
        # The parts that speak NATS, made once the agent is connected (`start`).
        self.nc: Client
        self.output: OutputShipper
        self.debugging: DebugSessions
        self.ranks: RankRunner
        self.presence: NodePresence
        self.requests: RequestServer  # what answers the requests of the agent's operations
        self._tasks: list[asyncio.Task[Any]] = []

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
        self._compose()
        await asyncio.to_thread(self.data.cache.open)  # partial copies a crash left are removed
        await asyncio.to_thread(self.images.cache.clean_partial)
        await self.ranks.adopt()  # before any request: a stop must find the jobs the agent before started
        self.ranks.spread_job_folders()
        await self.ranks.keep_pins()
        # What the agents before obeyed stays spent, and nothing signed before now is obeyed (agent/seen.py).
        await asyncio.to_thread(remember_across_restarts, self.control, self.root, time.time())
        self.requests = requests = RequestServer(self.nc, self.info.name)
        launcher, monitor = self._signed_by("launcher"), self._signed_by("monitor")
        await requests.serve(agents.RESERVE_PORTS, self._on_ports, launcher)
        await requests.serve(agents.START_PROCESSES, self._on_starts, launcher)
        await requests.serve(agents.START_PROCESS, self._on_start, launcher)
        await requests.serve(agents.STOP_PROCESSES, self._on_stop, launcher)
        await requests.serve(agents.EXEC_IN_JOB, self._on_exec, self._from_the_job)
        await requests.serve(agents.PRECHECK_NODE, self._on_precheck, monitor)
        await requests.serve(agents.RELEASE_WORKSPACES, self._on_release, monitor)
        await requests.serve(agents.STAGE_DATASET, self._on_stage, monitor)
        await requests.serve(agents.OPEN_SESSION, self._on_open_session, monitor)
        await self.presence.register()
        self._tasks.append(asyncio.create_task(self.presence.heartbeats()))
        self._tasks.append(asyncio.create_task(self.presence.probe_periodically()))
        self._tasks.append(asyncio.create_task(self.data.housekeeping(self.presence.on_disk_pressure)))
        self._tasks.append(asyncio.create_task(self.images.housekeeping()))
        # The node's dataset cache and its unpacked images, in one report whenever either changes.
        self._tasks.append(asyncio.create_task(self.data.reporting(self.output.publish_cache, self.images)))
        self.data.cache.changed.set()  # a first report: `trainyard cache` lists every node, its disk too
        log.info("agent.ready", node=self.info.name, cpus=self.info.cpus, memory_mib=self.info.memory_mib)

    def _compose(self) -> None:
        """Make the parts that speak NATS, on the agent's one connection."""
        nodes: dict[RankKey, RunningNode] = {}  # the ranks on this node, by (job, attempt, task, rank)
        self.output = OutputShipper(self.nc, self.info)
        self.debugging = DebugSessions(self.nc, self.info.name, self.root, nodes, self.images)
        self.ranks = RankRunner(self.nc, self.info, root=self.root, storage=self.storage, nats_url=self.nats_url,
                                backend=self.backend, hidden_paths=self.hidden_paths, ports=self.ports,
                                data=self.data, images=self.images, output=self.output, debugging=self.debugging,
                                nodes=nodes, host_interfaces=host_addresses())
        self.presence = NodePresence(self.nc, self.info, node_token=self.node_token, storage=self.storage,
                                     root=self.root, health_probe_seconds=self.health_probe_seconds, data=self.data,
                                     running=self.ranks.running_holders, each_beat=self.ranks.each_beat)

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
        given = self.ranks.job_tokens(request.job_id, request.attempt)
        if not any(hmac.compare_digest(token.encode(), known.encode()) for known in given):
            return f"the request does not carry the token of job {request.job_id} attempt {request.attempt}"
        return None

    # --- the requests, each to the part that answers it -------------------------------------------

    async def _on_ports(self, request: ReservePorts) -> PortsReserved | CommandError:
        return await self.ranks.reserve_ports(request)

    async def _on_start(self, request: StartProcess) -> ProcessAccepted | CommandError:
        return await self.ranks.accept_start(request)

    async def _on_starts(self, request: StartProcesses) -> StartsAnswered:
        """Each start as start-process takes one, in a span of the trace it carries (its job's)."""
        answers: list[ProcessAccepted | StartRefused] = []
        for item in request.starts:
            start = item.start
            with self.requests.part_span(agents.START_PROCESSES, item.trace, job_id=start.job_id,
                                         attempt=start.attempt, task=start.launch.task, rank=start.launch.rank):
                answer = await self.ranks.accept_start(start)
            answers.append(answer if isinstance(answer, ProcessAccepted)
                           else StartRefused(code=answer.code, message=answer.message[:2000]))
        return StartsAnswered(answers=answers)

    async def _on_stop(self, request: StopProcesses) -> Later:
        # A job's long graceful shutdown must not hold up the stops of other jobs on this node: the
        # reply comes once the processes are gone, while other requests are answered.
        return Later(self.ranks.begin_stop(request))

    async def _on_exec(self, request: ExecInJob) -> ProcessAccepted | CommandError:
        """Start the command now and answer; its exit code goes to `reply_to` when it ends."""
        if not request.reply_to.startswith(job_inbox(request.job_id) + "."):
            # Only the job's own inbox: a request cannot make the agent publish anywhere else.
            self.requests.refuse_reply(agents.EXEC_IN_JOB, request.job_id, request.reply_to,
                                       "the exit's reply_to is not under the job's inbox")
            return CommandError(code="invalid-request", message=f"reply_to must be under {job_inbox(request.job_id)}.")
        return await self.ranks.exec_in_job(request)

    async def _on_precheck(self, request: PrecheckNode) -> PrecheckReport:
        return await self.presence.precheck(request)

    async def _on_release(self, request: ReleaseWorkspaces) -> Released | CommandError:
        return await self.debugging.release(request)

    async def _on_stage(self, request: StageDataset) -> StageAccepted:
        """D2: a preload: the dataset is copied in the background; the cache reports show how far it is."""
        log.info("agent.preload", node=self.info.name, source=request.source, preload_id=request.preload_id)
        self.data.preload(request)
        return StageAccepted()

    async def _on_open_session(self, request: OpenSession) -> SessionOpened | CommandError:
        return await self.debugging.open(request)

    async def close(self) -> None:
        """Stop serving; the jobs run on under their holder, for the next agent to adopt (an upgrade or a
        restart of the agent does not end them; `python -m agent --end-jobs` does)."""
        for task in self._tasks:
            task.cancel()
        await self.debugging.end_all()
        self.ranks.leave_running()
        # NATS may be out of reach (a cut link): the agent goes all the same, as what it did not publish the
        # next one does; drain would wait for it for half a minute.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), timeout=CLOSE_DRAIN_SECONDS)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.ranks.abandon_relays()  # and those of starts handled while the connection drained
        self.ports.close()  # the next agent holds again the ports of the jobs it adopts
        self.ranks.holders.close()  # it ends once its commands have
        self.data.cache.close()
