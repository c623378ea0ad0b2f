"""Simulated node agents' answers to the launcher: ports, starts and stops, with processes that only pretend.

A started "process" is a timer: it is reported started at once and exited with code 0 `seconds` later, each report
published to the agent-reports stream with the message id a real agent gives it, so the launcher sees what it sees
from real agents. Every connection of the simulated agents subscribes in one queue group, so each request is
answered once, by whichever connection gets it; the processes are kept here, for all nodes together. The launcher's
signature on a request is not checked (a real agent checks it): what is measured is the services' side.
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.contracts import subjects
from libs.contracts.agent import (
    PortsReserved,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    ReservePorts,
    StartProcess,
    Stopped,
    StopProcesses,
)
from libs.contracts.codec import decode, encode
from libs.messaging.connection import round_trip

QUEUE = "simulated-agents"
Key = tuple[str, int, int, int, str]  # job, attempt, task, rank, node


class SimulatedAgents:
    """The nodes' processes, started and stopped on request and ended on schedule."""

    def __init__(self, js: JetStreamContext, *, seconds: float) -> None:
        self.js = js
        self.seconds = seconds
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self.stops: dict[Key, asyncio.Event] = {}  # a running process's: set when it is stopped
        self.known: set[Key] = set()
        self.exited = 0
        self._pids = itertools.count(1000)
        self._ports = itertools.cycle(range(20000, 30000))

    async def serve(self, nc: Client) -> None:
        """Answer every simulated node's ports, start and stop requests arriving on `nc`."""
        await nc.subscribe(subjects.agent_ports("*"), queue=QUEUE, cb=self._ports_asked)
        await nc.subscribe(subjects.agent_start("*"), queue=QUEUE, cb=self._start_asked)
        await nc.subscribe(subjects.agent_stop("*"), queue=QUEUE, cb=self._stop_asked)
        await round_trip(nc)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _ports_asked(self, msg: Msg) -> None:
        request = decode(msg.data, ReservePorts)
        await msg.respond(encode(PortsReserved(ports=[next(self._ports) for _ in range(request.count)])))

    async def _start_asked(self, msg: Msg) -> None:
        request = decode(msg.data, StartProcess)
        launch = request.launch
        key = (request.job_id, request.attempt, launch.task, launch.rank, launch.node)
        known = key in self.known
        await msg.respond(encode(ProcessAccepted(already_known=known)))
        if not known:
            self.known.add(key)
            self.stops[key] = asyncio.Event()
            self.tasks[key] = asyncio.create_task(self._process(key))

    async def _process(self, key: Key) -> None:
        job_id, attempt, task, rank, node = key
        started = ProcessStarted(job_id=job_id, attempt=attempt, rank=rank, task=task, node=node,
                                 pid=next(self._pids))
        await self._report(node, started, key, "started")
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

    async def _stop_asked(self, msg: Msg) -> None:
        request = decode(msg.data, StopProcesses)
        node = msg.subject.split(".")[2]  # trainyard.agent.<node>.stop
        stopping = [stop for key, stop in self.stops.items() if key[:2] == (request.job_id, request.attempt)
                    and key[4] == node and request.task in (None, key[2])]
        for stop in stopping:
            stop.set()
        await msg.respond(encode(Stopped(stopped=len(stopping))))

    async def _report(self, node: str, report: ProcessStarted | ProcessExited, key: Key, kind: str) -> None:
        msg_id = f"{key[0]}.{key[1]}.{key[2]}.{key[3]}.{kind}"
        await self.js.publish(subjects.agent_report(node), encode(report), headers={"Nats-Msg-Id": msg_id})
