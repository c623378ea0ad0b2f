"""A real node agent on real NATS for the agent tests: registered by a stand-in for the monitor, with
its process reports collected, and the client's side of a debug session. The tests speak for the
launcher and the monitor with their signing keys (of `CONTROL_SECRET`)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.agent import NodeAgent
from libs.contracts import subjects
from libs.contracts.agent import (
    NodeAccepted,
    OpenSession,
    PortsReserved,
    ProcessAccepted,
    ProcessExited,
    ProcessReport,
    ProcessStarted,
    SessionControl,
    SessionExited,
    SessionOpened,
    StartProcess,
    StartsAnswered,
    Stopped,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode, decode_any, encode
from libs.contracts.events import NodeLaunch
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlSigner, ControlVerifier
from libs.messaging.rpc import call

WAIT_SECONDS = 30
CONTROL_SECRET = "agent-tests-" * 4
LAUNCHER = ControlSigner.of(CONTROL_SECRET, "launcher")
MONITOR = ControlSigner.of(CONTROL_SECRET, "monitor")
# Who sends what to an agent; exec comes from a job, with the job's token instead of a signature.
SENDERS: dict[Callable[[str], str], ControlSigner] = {
    subjects.agent_ports: LAUNCHER, subjects.agent_start: LAUNCHER, subjects.agent_starts: LAUNCHER,
    subjects.agent_stop: LAUNCHER,
    subjects.agent_precheck: MONITOR,
    subjects.agent_release: MONITOR, subjects.agent_open_session: MONITOR}


def signed(subject: Callable[[str], str], node: str, payload: bytes) -> dict[str, str]:
    """The headers the owner of `subject` sends `payload` to `node` with."""
    signer = SENDERS.get(subject)
    return {} if signer is None else signer.headers(subject(node), payload, time.time())


async def start_agent(nats_url: str, name: str, home: Path, *, storage: Path | None = None,
                      health_probe_seconds: float = 0.2, node_token: str | None = None) -> NodeAgent:
    """An agent for node `name` with its folder under `home` (shared storage: `home/storage`); `node_token` for a
    real monitor to accept it."""
    agent = NodeAgent(NodeInfo(name=name, address="127.0.0.1", cpus=1, memory_mib=256), nats_url=nats_url,
                      root=home / "agents" / name, storage=storage or home / "storage",
                      health_probe_seconds=health_probe_seconds, control=ControlVerifier.of_secret(CONTROL_SECRET),
                      node_token=node_token)
    await agent.start()
    return agent


@dataclass
class Node:
    """A running agent, the connection that talks to it, and the process reports it published."""

    agent: NodeAgent
    nc: Client
    storage: Path
    job_id: str
    reports: list[ProcessReport] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.agent.info.name

    async def run(self, launch: NodeLaunch, attempt: int = 1) -> int:
        """Start one node of the job and wait for its exit code."""
        await call(self.nc, subjects.agent_start(self.name),
                   StartProcess(job_id=self.job_id, attempt=attempt, launch=launch), reply_type=ProcessAccepted,
                   signer=LAUNCHER)
        exited = await self.report(ProcessExited, attempt, rank=launch.rank)
        assert isinstance(exited, ProcessExited)
        return exited.exit_code

    async def ask(self, subject: Callable[[str], str], payload: bytes, headers: dict[str, str] | None = None) -> Any:
        """Send raw bytes as a request (no retry: one request, one answer), as the subject's owner would
        send them (signed) unless `headers` are given, and decode the reply."""
        sent = signed(subject, self.name, payload) if headers is None else headers
        reply = await self.nc.request(subject(self.name), payload, timeout=WAIT_SECONDS, headers=sent)
        return decode_any(reply.data, ProcessAccepted | StartsAnswered | PortsReserved | Stopped | CommandError)

    async def report(self, kind: type[ProcessReport], attempt: int = 1, *, rank: int | None = None) -> ProcessReport:
        """The first report of `kind`: a start reported with its exit is a start too."""
        async with asyncio.timeout(WAIT_SECONDS):
            while True:
                for report in [*self.reports, *self.starts()]:
                    if isinstance(report, kind) and report.attempt == attempt and rank in (None, report.rank):
                        return report
                await asyncio.sleep(0.05)

    def starts(self) -> list[ProcessStarted]:
        """The starts reported, on their own or with their exits."""
        return [report for report in self.reports if isinstance(report, ProcessStarted)] + [
            report.started for report in self.reports if isinstance(report, ProcessExited) and report.started]

    def nothing_started(self) -> bool:
        jobs = self.agent.root / "jobs"  # made at the agent's start, empty until a job's folder is made
        return not self.agent.ranks.nodes and not (jobs.exists() and any(jobs.iterdir())) and not self.reports

    def session(self) -> Session:
        """A debug session in this node's job, not opened yet."""
        return Session(self.nc, self.name, self.job_id)

    async def restart(self, *, wiped: bool = False) -> None:
        """Close the agent and start a new one, as a restart of `python -m agent` would: the same node and
        folder, nothing else carried over (its verifier of signed requests is a new one too); `wiped`: its
        folder removed in between, as a new disk would have it."""
        name, root, nats_url = self.name, self.agent.root, self.agent.nats_url
        probe_seconds = self.agent.health_probe_seconds
        await self.agent.close()
        if wiped:
            shutil.rmtree(root)
        self.agent = await start_agent(nats_url, name, root.parent.parent, storage=self.storage,
                                       health_probe_seconds=probe_seconds)


@contextlib.asynccontextmanager
async def registered_node(nc: Client, nats_url: str, home: Path, *, job_id: str, storage: Path | None = None,
                          health_probe_seconds: float = 0.2) -> AsyncIterator[Node]:
    """A node agent whose registration a stand-in for the monitor accepts, until the block ends."""

    async def accept(msg: Msg) -> None:  # the monitor's part of registration
        await msg.respond(encode(NodeAccepted(heartbeat_seconds=0.2)))

    name = f"node-{uuid.uuid4().hex[:8]}"
    storage = storage or home / "storage"
    before = asyncio.all_tasks()
    registrar = await nc.subscribe(REGISTER_NODE.subject, cb=accept)
    agent = await start_agent(nats_url, name, home, storage=storage, health_probe_seconds=health_probe_seconds)
    node = Node(agent=agent, nc=nc, storage=storage, job_id=job_id)

    async def collect(msg: Msg) -> None:
        node.reports.append(decode_any(msg.data, ProcessReport))

    reports = await nc.subscribe(subjects.agent_report(name), cb=collect)
    try:
        yield node
    finally:
        await node.agent.close()
        await reports.unsubscribe()
        await registrar.unsubscribe()
        await _left_nothing_running(before)


async def _left_nothing_running(before: set[asyncio.Task[Any]]) -> None:
    """An agent closed in a process that goes on (an upgrade in place, these tests) leaves no task behind: one
    retrying to publish on its closed connection would do so for as long as the process lives. (The agent's
    connection is closed, and its subscriptions with it; those still open are the test's own.)"""
    def ours(task: asyncio.Task[Any]) -> bool:
        return getattr(task.get_coro(), "__qualname__", None) != "Subscription._wait_for_msgs"

    def left() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task() and ours(t)]

    # A cancelled task ends when the loop next gets to it, which a loaded machine may take a while to do.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT_SECONDS):
            while left():
                await asyncio.sleep(0.1)
    if running := left():
        raise AssertionError(f"the closed agent left tasks running: {[t.get_coro() for t in running]}")


@dataclass
class Session:
    """The client's side of a debug session: what came out, and how it ended."""

    nc: Client
    node: str
    job_id: str
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    owner: str = "user-alice"
    out: bytearray = field(default_factory=bytearray)
    exits: list[int] = field(default_factory=list)
    subscriptions: list[Any] = field(default_factory=list)

    async def open(self, **fields: Any) -> SessionOpened | CommandError:
        async def output(msg: Msg) -> None:
            self.out.extend(msg.data)

        async def ended(msg: Msg) -> None:
            self.exits.append(decode(msg.data, SessionExited).exit_code)

        # Listening first: the agent may publish output before its reply arrives.
        self.subscriptions = [await self.nc.subscribe(self._subject("out"), cb=output),
                              await self.nc.subscribe(self._subject("exit"), cb=ended)]
        reply: SessionOpened | CommandError = await call(
            self.nc, subjects.agent_open_session(self.node),
            OpenSession(session_id=self.session_id, job_id=self.job_id, owner=self.owner, **fields),
            reply_type=SessionOpened | CommandError, signer=MONITOR)
        return reply

    async def type(self, text: str) -> None:
        await self.nc.publish(self._subject("in"), text.encode())

    async def control(self, control: SessionControl) -> None:
        await self.nc.publish(self._subject("control"), encode(control))

    def _subject(self, channel: str) -> str:
        return subjects.session(self.node, self.owner, self.session_id, channel)

    async def until_output(self, text: str) -> None:
        async with asyncio.timeout(WAIT_SECONDS):
            while text.encode() not in self.out:
                await asyncio.sleep(0.05)

    async def exit_code(self) -> int:
        async with asyncio.timeout(WAIT_SECONDS):
            while not self.exits:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # a second SessionExited would have arrived by now
        for subscription in self.subscriptions:
            await subscription.unsubscribe()
        assert len(self.exits) == 1
        return self.exits[0]

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")
