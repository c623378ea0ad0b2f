"""A monitor started from a snapshot of its live state, on real NATS and PostgreSQL, holds what one that folds its
whole log and replays every stream holds, once it has folded the rest: its nodes, runs and alerts, the scheduler's
jobs and the attempts it watches; a job archived before the snapshot is not folded again.

The scheduler's and the launcher's sides are played by appending to their event stores and publishing them with
their outbox relays, as theirs would; node-a registers as its agent does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client

from libs.auth import issue_node_token
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.cluster import ClusterConfig, NodeInfo
from libs.contracts.events import (
    Event,
    JobAdmitted,
    JobArchived,
    JobFailed,
    JobSubmitted,
    JobSucceeded,
    NodeProcessExited,
    NodeProcessStarted,
    Placement,
    RunBegan,
    RunFinished,
)
from libs.contracts.jobspec import CheckpointResume, PerformanceDetection
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.rpc import call
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.monitor.service import Monitor
from tests.support.monitor import CLUSTER
from tests.support.specs import sleeper
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET = "integration-tests-signing-secret-0123456789abcdef"
AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
PLACED = [Placement(rank=0, node="node-a", address="127.0.0.1", slots=1)]
SPEC = msgspec.structs.replace(sleeper("watched"), pool="resilient", checkpoint_resume=CheckpointResume(
    performance=PerformanceDetection(threshold=0.8, window=2)))
WAIT = 30.0


def job(index: int) -> str:
    return f"job-{index:012x}"


class FoldingAll(Monitor):
    """A monitor that takes no snapshot and folds its whole log and every stream from the first message."""

    snapshot_code = ()


class Platform:
    """The scheduler's and the launcher's logs, published by their relays; the monitors started on them."""

    def __init__(self, nc: Client, scheduler: EventStore, launcher: EventStore, monitor_log: EventStore,
                 settings: Settings) -> None:
        self.nc = nc
        self.logs = {"job": scheduler, "launch": launcher}
        self.relays = {kind: OutboxRelay(store, nc.jetstream()) for kind, store in self.logs.items()}
        self.monitor_log = monitor_log
        self.settings = settings
        self.versions: dict[tuple[str, str], int] = {}
        self.runtimes: list[ServiceRuntime] = []

    async def start(self, kind: type[Monitor] = Monitor) -> Monitor:
        runtime = ServiceRuntime("monitor", self.settings)
        await runtime.start()
        self.runtimes.append(runtime)
        monitor = kind(runtime, ClusterConfig.load(CLUSTER))
        await monitor.start()
        await runtime.listen()
        await monitor.caught_up()
        return monitor

    async def stop(self, monitor: Monitor) -> None:
        await monitor.rt.close()
        self.runtimes.remove(monitor.rt)

    def unstarted(self) -> Monitor:
        runtime = SimpleNamespace(store=self.monitor_log, js=self.nc.jetstream(), settings=self.settings, nc=None)
        return Monitor(cast(ServiceRuntime, runtime), ClusterConfig.load(CLUSTER))

    async def register(self) -> None:
        info = NodeInfo(name="node-a", address="127.0.0.1", cpus=8, memory_mib=16384)
        accepted = await call(self.nc, REGISTER_NODE.subject, RegisterNode(node=info),
                              reply_type=NodeAccepted | CommandError, token=issue_node_token(SECRET, "node-a"))
        assert isinstance(accepted, NodeAccepted)

    async def records(self, aggregate_type: str, job_id: str, *events: Event) -> None:
        """Append to the scheduler's log ("job") or the launcher's ("launch") and publish, as they do."""
        key = (aggregate_type, job_id)
        version = self.versions.get(key, 0)
        await self.logs[aggregate_type].append([NewEvent(aggregate_type, job_id, e) for e in events],
                                               expected_versions={key: version})
        self.versions[key] = version + len(events)
        while await self.relays[aggregate_type].publish_pending():
            pass

    async def runs(self, index: int) -> None:
        await self.records("job", job(index), JobSubmitted(job_id=job(index), spec=SPEC, creator="alice"),
                           JobAdmitted(job_id=job(index), attempt=1, flavor="cpu-1", placement=PLACED))
        await self.records("launch", job(index), NodeProcessStarted(job_id=job(index), attempt=1, rank=0,
                                                                    node="node-a", pid=7, started_at=AT))
        await eventually(lambda: self.recorded(RunBegan, job(index)), WAIT)

    async def ends(self, index: int, code: int) -> None:
        await self.records("launch", job(index), NodeProcessExited(job_id=job(index), attempt=1, rank=0,
                                                                   node="node-a", exit_code=code, exited_at=AT))
        ending = JobSucceeded(job_id=job(index)) if code == 0 else JobFailed(job_id=job(index), reason="exit 1")
        await self.records("job", job(index), ending)
        await eventually(lambda: self.recorded(RunFinished, job(index)), WAIT)

    async def recorded(self, kind: type, job_id: str) -> bool:
        return any([isinstance(e.event, kind) and getattr(e.event, "job_id", None) == job_id
                    async for e in self.monitor_log.read_all()])

    async def settled(self, monitor: Monitor) -> None:
        async def handled() -> bool:
            return not any([await follower.lag() for follower in monitor.followers])

        await eventually(handled, WAIT)
        await asyncio.sleep(0.3)


@pytest_asyncio.fixture(loop_scope="session")
async def platform(nc: Client, nats_url: str, database_url: str,
                   make_store: StoreFactory) -> AsyncIterator[Platform]:
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, smtp_url=None,
                        alert_emails=("ops@example.com",), node_lost_seconds=3600)
    stack = Platform(nc, await make_store("scheduler"), await make_store("launcher"), await make_store("monitor"),
                     settings)
    yield stack
    for runtime in stack.runtimes:
        await runtime.close()


async def test_a_monitor_started_from_its_snapshot_holds_what_folding_everything_holds(platform: Platform) -> None:
    first = await platform.start()
    await platform.register()
    for index in range(3):
        await platform.runs(index)
    await platform.ends(0, 1)
    await platform.ends(1, 0)
    await platform.records("job", job(0), JobArchived(job_id=job(0), retention="1h"))
    await platform.settled(first)
    assert first.detector.watching(job(2))
    assert await eventually(first.take_snapshot, WAIT)

    # After the snapshot: another archived, one ends, one more runs.
    await platform.records("job", job(1), JobArchived(job_id=job(1), retention="1h"))
    await platform.ends(2, 0)
    await platform.runs(3)
    await platform.settled(first)
    await platform.stop(first)

    restoring = platform.unstarted()
    restored = await restoring.restore()
    assert restored.own_after and dict(restored.upstream_after)
    assert job(0) not in restoring.jobs.jobs and job(0) not in restoring.state.runs  # not folded again
    assert job(1) in restoring.jobs.jobs and restoring.detector.watching(job(2))
    assert "node-a" in restoring.state.nodes

    again = await platform.start()
    await platform.settled(again)
    assert again._upstream_after == restored.upstream_after
    assert job(1) not in again.jobs.jobs and again.detector.watching(job(3)) and not again.detector.watching(job(2))
    await platform.stop(again)

    rebuilt = await platform.start(FoldingAll)
    await platform.settled(rebuilt)
    assert rebuilt._upstream_after == {}
    assert again.save_state() == rebuilt.save_state()
    assert again.versions == rebuilt.versions
