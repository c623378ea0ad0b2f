"""A launcher on an in-memory event log, following the scheduler's events and the agents' reports the way
its followers would deliver them; node agents are a fake that answers every call and remembers it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.aio.msg import Msg

from libs.contracts.agent import (
    PortsReserved,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    ReservePorts,
    StartProcess,
    StartProcesses,
    StartsAnswered,
    Stopped,
    StopProcesses,
)
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobSubmitted,
    LaunchPlanned,
    NodeLaunch,
    Placement,
    SettingsChanged,
)
from libs.contracts.jobspec import JobSpec
from libs.controlsign import ControlSigner
from libs.eventstore import Tracking
from libs.messaging.rpc import ServiceUnavailable
from services.launcher import dispatcher as launcher_dispatcher
from services.launcher.planner import NodeLaunches
from services.launcher.service import Launcher
from tests.support.eventlog import EventLog, fake_runtime
from tests.support.platform import CLUSTER, JOB

GRACE = 10.0  # the platform's stop grace for jobs without checkpoint resume


def launches(plan: LaunchPlanned) -> list[NodeLaunch]:
    """What every node of a recorded plan is started with."""
    return NodeLaunches.of(plan).every()


class Agents:
    """Node agents: they choose ports and answer every start and stop, except on nodes that are unreachable."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, float]] = []
        self.unreachable: set[str] = set()
        self.hold: asyncio.Event | None = None  # the next call's answer waits for it
        self.next_port = 30000  # the next port an agent chooses

    async def __call__(self, _: object, subject: str, request: Any, *, timeout: float, reply_type: object,
                       signer: ControlSigner) -> Any:
        assert signer.role == "launcher"  # a real agent obeys only the launcher's signature
        self.calls.append((subject, request, timeout))
        node = subject.split(".")[2]
        if node in self.unreachable:
            raise ServiceUnavailable(f"nothing answers on {subject}")
        hold, self.hold = self.hold, None
        if hold is not None:
            await hold.wait()
        if isinstance(request, ReservePorts):
            self.next_port += request.count
            return PortsReserved(ports=list(range(self.next_port - request.count, self.next_port)))
        if isinstance(request, StartProcesses):
            return StartsAnswered(answers=[ProcessAccepted(already_known=False)] * len(request.starts))
        return Stopped(stopped=1)

    def stops(self) -> list[tuple[str, StopProcesses, float]]:
        return [(subject.split(".")[2], request, timeout) for subject, request, timeout in self.calls
                if isinstance(request, StopProcesses)]

    def starts(self) -> list[StartProcess]:
        """Every start sent, in the order sent (several in a request, each node's due starts together)."""
        return [item.start for _, request, _ in self.calls if isinstance(request, StartProcesses)
                for item in request.starts]


class Site:
    """A launcher following the scheduler's events and the agents' reports."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log = EventLog()
        self.agents = Agents()
        monkeypatch.setattr(launcher_dispatcher, "call", self.agents)
        self.clock = [1000.0]
        monkeypatch.setattr(launcher_dispatcher, "time", SimpleNamespace(monotonic=lambda: self.clock[0]))
        runtime = fake_runtime(self.log, "launcher", stop_grace_seconds=GRACE, stop_give_up_seconds=60.0)
        self.launcher = Launcher(runtime, CLUSTER)
        self.upstreams = {upstream.consumer: upstream for upstream in self.launcher.upstreams()}
        self.reports = 0

    async def scheduler(self, event: Any) -> None:
        aggregate_type, aggregate_id = ("settings", "platform") if isinstance(event, SettingsChanged) \
            else ("job", event.job_id)
        envelope: EventEnvelope = self.log.record("scheduler", aggregate_type, aggregate_id, event)
        await self.launcher.on_upstream(self.upstreams["scheduler-events"], envelope, None,
                                        Tracking("scheduler-events", envelope.position))

    async def report(self, report: ProcessStarted | ProcessExited) -> None:
        self.reports += 1
        msg = cast(Msg, SimpleNamespace(headers=None))
        await self.launcher.on_upstream(self.upstreams["agent-reports"], report, msg,
                                        Tracking("agent-reports", self.reports))

    async def admit(self, spec: JobSpec, nodes: list[str], attempt: int = 1, job_id: str = JOB) -> None:
        """The scheduler admits the job (submitted first, for its first attempt) with a rank on each of `nodes`."""
        if attempt == 1:
            await self.scheduler(JobSubmitted(job_id=job_id, spec=spec, creator="alice"))
        placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(nodes)]
        await self.scheduler(JobAdmitted(job_id=job_id, attempt=attempt, flavor="cpu-4", placement=placement))

    async def run(self, spec: JobSpec, nodes: list[str], attempt: int = 1) -> None:
        """Submit and admit the job, start it, and have every rank report started."""
        await self.admit(spec, nodes, attempt)
        await self.dispatch()  # the nodes choose the rendezvous ports
        await self.dispatch()  # the attempt is planned and started
        for rank, node in enumerate(nodes):
            await self.report(ProcessStarted(job_id=JOB, attempt=attempt, rank=rank, node=node, pid=100 + rank))

    async def exited(self, rank: int, node: str, code: int, attempt: int = 1) -> None:
        await self.report(ProcessExited(job_id=JOB, attempt=attempt, rank=rank, node=node, exit_code=code))

    async def dispatch(self) -> None:
        self.clock[0] += 60.0  # whatever was sent before is due again
        await self.launcher.dispatcher.dispatch_once()

    def recorded(self, kind: type) -> list[Any]:
        return [e for e in self.log.of("launcher", JOB) if isinstance(e, kind)]
