"""Simulated node agents' answers to the launcher: ports, starts and stops, with processes that only pretend.

A started "process" is a timer: it is reported started at once and exited with code 0 `seconds` later, each report
published to the agent-reports stream with the message id a real agent gives it, so the launcher sees what it sees
from real agents. Every connection of the simulated agents subscribes in one queue group, so each request is
answered once, by whichever connection gets it; the processes are kept here, for all nodes together. The launcher's
signature on a request is not checked (a real agent checks it): what is measured is the services' side.

The monitor's pre-checks are answered too (every node healthy, with room). A node `silence`d answers nothing from
then on, as a node that went away: its processes neither stop nor report. `answered` keeps, per kind of request and
attempt, when the first and the last answer went out and to which nodes' requests, so a benchmark can tell the
launcher's sending from the services' recording, and `wait_answered` waits for a count of them. A run of millions of
jobs passes `remember=False`: a process is forgotten once it exited and no answer is noted, so that the simulated
agents hold only the processes that run (a start the launcher sends again after an exit, which a real agent answers
from its own records, starts the process again; its reports carry the same message ids, which JetStream drops as
duplicates within its window).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.contracts import subjects
from libs.contracts.agent import (
    PortsReserved,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    ReservePorts,
    StartProcess,
    StartProcesses,
    StartRefused,
    StartsAnswered,
    Stopped,
    StopProcesses,
)
from libs.contracts.codec import decode, encode
from libs.messaging.connection import round_trip

QUEUE = "simulated-agents"
Key = tuple[str, int, int, int, str]  # job, attempt, task, rank, node
Kind = str  # what was answered: "ports", "start", "stop", "precheck" (attempt 0), "started" (the report published)


@dataclass
class Answered:
    """The answers of one kind to one attempt's requests: when the first and the last went out, to which nodes."""

    first: datetime
    last: datetime
    count: int = 0
    nodes: set[str] = field(default_factory=set)


class SimulatedAgents:
    """The nodes' processes, started and stopped on request and ended on schedule."""

    def __init__(self, js: JetStreamContext, *, seconds: float, remember: bool = True) -> None:
        """Each process exits with code 0 `seconds` after its start (0: at once), unless stopped first.
        `remember`: keep every process's key (`known`) and every answer (`answered`) for the whole run."""
        self.js = js
        self.seconds = seconds
        self.remember = remember
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self.stops: dict[Key, asyncio.Event] = {}  # a running process's: set when it is stopped
        self.known: set[Key] = set()
        self.exited = 0
        self.silent: set[str] = set()
        self.answered: dict[tuple[Kind, str, int], Answered] = {}
        self._changed = asyncio.Event()
        self._pids = itertools.count(1000)
        self._ports = itertools.cycle(range(20000, 30000))

    async def serve(self, nc: Client) -> None:
        """Answer every simulated node's ports, start and stop requests arriving on `nc`."""
        await nc.subscribe(subjects.agent_ports("*"), queue=QUEUE, cb=self._ports_asked)
        await nc.subscribe(subjects.agent_start("*"), queue=QUEUE, cb=self._start_asked)
        await nc.subscribe(subjects.agent_starts("*"), queue=QUEUE, cb=self._starts_asked)
        await nc.subscribe(subjects.agent_stop("*"), queue=QUEUE, cb=self._stop_asked)
        await nc.subscribe(subjects.agent_precheck("*"), queue=QUEUE, cb=self._precheck_asked)
        await round_trip(nc)

    def silence(self, node: str) -> None:
        """Answer none of `node`'s requests from now on, as a node that went away."""
        self.silent.add(node)

    async def wait_answered(self, kind: Kind, job_id: str, attempt: int, count: int) -> Answered:
        """Once `count` requests of `kind` of the attempt were answered (`attempt` 0 for pre-checks)."""
        while (found := self.answered.get((kind, job_id, attempt))) is None or found.count < count:
            self._changed.clear()
            await self._changed.wait()
        return found

    def _note(self, kind: Kind, job_id: str, attempt: int, node: str) -> None:
        if not self.remember:
            return
        now = datetime.now(UTC)
        found = self.answered.setdefault((kind, job_id, attempt), Answered(first=now, last=now))
        found.last = now
        found.count += 1
        found.nodes.add(node)
        self._changed.set()

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    @staticmethod
    def _node(msg: Msg) -> str:
        return msg.subject.split(".")[2]  # trainyard.agent.<node>.<request>

    async def _ports_asked(self, msg: Msg) -> None:
        if (node := self._node(msg)) in self.silent:
            return
        request = decode(msg.data, ReservePorts)
        await msg.respond(encode(PortsReserved(ports=[next(self._ports) for _ in range(request.count)])))
        self._note("ports", request.job_id, request.attempt, node)

    async def _precheck_asked(self, msg: Msg) -> None:
        if (node := self._node(msg)) in self.silent:
            return
        request = decode(msg.data, PrecheckNode)
        await msg.respond(encode(PrecheckReport(node=node, checks=[])))
        self._note("precheck", request.job_id, 0, node)

    async def _start_asked(self, msg: Msg) -> None:
        if self._node(msg) in self.silent:
            return
        request = decode(msg.data, StartProcess)
        await msg.respond(encode(self._accept(request)))

    async def _starts_asked(self, msg: Msg) -> None:
        if self._node(msg) in self.silent:
            return
        request = decode(msg.data, StartProcesses)
        answers: list[ProcessAccepted | StartRefused] = [self._accept(item.start) for item in request.starts]
        await msg.respond(encode(StartsAnswered(answers=answers)))

    def _accept(self, request: StartProcess) -> ProcessAccepted:
        launch = request.launch
        key = (request.job_id, request.attempt, launch.task, launch.rank, launch.node)
        known = key in self.known
        self._note("start", request.job_id, request.attempt, launch.node)
        if not known:
            self.known.add(key)
            self.stops[key] = asyncio.Event()
            self.tasks[key] = asyncio.create_task(self._process(key))
        return ProcessAccepted(already_known=known)

    async def _process(self, key: Key) -> None:
        job_id, attempt, task, rank, node = key
        started = ProcessStarted(job_id=job_id, attempt=attempt, rank=rank, task=task, node=node,
                                 pid=next(self._pids))
        await self._report(node, started, key, "started")
        self._note("started", job_id, attempt, node)
        try:
            await asyncio.wait_for(self.stops[key].wait(), self.seconds)
            exit_code = -15  # stopped (SIGTERM)
        except TimeoutError:
            exit_code = 0
        exited = ProcessExited(job_id=job_id, attempt=attempt, rank=rank, task=task, node=node,
                               exit_code=exit_code, exited_at=datetime.now(UTC))
        del self.stops[key]
        await self._report(node, exited, key, "exited")
        self.exited += 1
        del self.tasks[key]
        if not self.remember:
            self.known.discard(key)

    async def _stop_asked(self, msg: Msg) -> None:
        if (node := self._node(msg)) in self.silent:
            return
        request = decode(msg.data, StopProcesses)
        stopping = [stop for key, stop in self.stops.items() if key[:2] == (request.job_id, request.attempt)
                    and key[4] == node and request.task in (None, key[2])]
        for stop in stopping:
            stop.set()
        await msg.respond(encode(Stopped(stopped=len(stopping))))
        if request.task is None:
            self._note("stop", request.job_id, request.attempt, node)

    async def _report(self, node: str, report: ProcessStarted | ProcessExited, key: Key, kind: str) -> None:
        msg_id = f"{key[0]}.{key[1]}.{key[2]}.{key[3]}.{kind}"
        await self.js.publish(subjects.agent_report(node), encode(report), headers={"Nats-Msg-Id": msg_id})
