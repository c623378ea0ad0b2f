"""An autoscaler started from a snapshot of its live state, on real NATS and PostgreSQL, holds what one that folds
its whole log and replays every stream holds, once it has folded the rest: its instances and their readiness (a
reaction to the monitor's events), the jobs, the nodes and the log it shows; a job archived before the snapshot is
not folded again.

The scheduler's and the monitor's sides are played by appending to their event stores and publishing them with their
outbox relays; the autoscaler's decisions are recorded as its scale loop would record them (it runs none here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace
from typing import cast

import pytest
import pytest_asyncio
from nats.aio.client import Client

from libs.contracts.cluster import Accelerators, NodeInfo
from libs.contracts.events import (
    Event,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobAdmitted,
    JobArchived,
    JobSubmitted,
    JobSucceeded,
    NodeRegistered,
    NodeRetired,
    Placement,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.settings import Settings
from libs.skeleton.eventsourced import Loop
from libs.skeleton.runtime import ServiceRuntime
from services.autoscaler.service import Autoscaler
from tests.support.autoscaling import CLUSTER
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET = "integration-tests-signing-secret-0123456789abcdef"
SPEC = JobSpec(name="j", flavors=["gpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
               output=OutputRef(name="o"))
WAIT = 30.0


def job(index: int) -> str:
    return f"job-{index:012x}"


class Deciding(Autoscaler):
    """The autoscaler without its scale loop: what it decides, the test records."""

    def loops(self) -> Mapping[str, Loop]:
        return {}


class FoldingAll(Deciding):
    """One that takes no snapshot and folds its whole log and every stream from the first message."""

    snapshot_code = ()


class Platform:
    def __init__(self, nc: Client, scheduler: EventStore, monitor: EventStore, autoscaler_log: EventStore,
                 settings: Settings) -> None:
        self.nc = nc
        self.logs = {"job": scheduler, "node": monitor}
        self.relays = {kind: OutboxRelay(store, nc.jetstream()) for kind, store in self.logs.items()}
        self.autoscaler_log = autoscaler_log
        self.settings = settings
        self.versions: dict[tuple[str, str], int] = {}
        self.runtimes: list[ServiceRuntime] = []

    async def start(self, kind: type[Autoscaler] = Deciding) -> Autoscaler:
        runtime = ServiceRuntime("autoscaler", self.settings)
        await runtime.start()
        self.runtimes.append(runtime)
        autoscaler = kind(runtime, CLUSTER, providers={})
        await autoscaler.start()
        await runtime.listen()
        await autoscaler.caught_up()
        return autoscaler

    async def stop(self, autoscaler: Autoscaler) -> None:
        await autoscaler.rt.close()
        self.runtimes.remove(autoscaler.rt)

    def unstarted(self) -> Autoscaler:
        runtime = SimpleNamespace(store=self.autoscaler_log, js=self.nc.jetstream(), settings=self.settings)
        return Autoscaler(cast(ServiceRuntime, runtime), CLUSTER, providers={})

    async def records(self, aggregate_type: str, aggregate_id: str, *events: Event) -> None:
        """Append to the scheduler's log ("job") or the monitor's ("node") and publish, as they do."""
        key = (aggregate_type, aggregate_id)
        version = self.versions.get(key, 0)
        await self.logs[aggregate_type].append([NewEvent(aggregate_type, aggregate_id, e) for e in events],
                                               expected_versions={key: version})
        self.versions[key] = version + len(events)
        while await self.relays[aggregate_type].publish_pending():
            pass

    async def queued(self, index: int) -> None:
        await self.records("job", job(index), JobSubmitted(job_id=job(index), spec=SPEC, creator="alice"))

    async def runs(self, index: int, node: str) -> None:
        await self.records("job", job(index), JobAdmitted(job_id=job(index), attempt=1, flavor="gpu-1", placement=[
            Placement(rank=0, node=node, address="10.0.0.9", slots=1)]))

    async def registers(self, node: str) -> None:
        await self.records("node", node, NodeRegistered(node=NodeInfo(
            name=node, address="10.0.0.9", cpus=8.0, memory_mib=32768,
            accelerators=[Accelerators(board="a100", count=2)])))

    @staticmethod
    async def decides(autoscaler: Autoscaler,
                      *events: InstanceRequested | InstanceLaunched | InstanceReleased) -> None:
        """What its scale loop would decide: recorded under its lock."""
        async with autoscaler.lock:
            await autoscaler.record([NewEvent("instance", e.instance, e) for e in events])

    @staticmethod
    async def ready(autoscaler: Autoscaler, instance: str) -> None:
        async def is_ready() -> bool:
            return autoscaler.state.instances[instance].ready_at is not None

        await eventually(is_ready, WAIT)

    @staticmethod
    async def settled(autoscaler: Autoscaler) -> None:
        async def handled() -> bool:
            return not any([await follower.lag() for follower in autoscaler.followers])

        await eventually(handled, WAIT)
        await asyncio.sleep(0.3)


@pytest_asyncio.fixture(loop_scope="session")
async def platform(nc: Client, nats_url: str, database_url: str,
                   make_store: StoreFactory) -> AsyncIterator[Platform]:
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET)
    stack = Platform(nc, await make_store("scheduler"), await make_store("monitor"), await make_store("autoscaler"),
                     settings)
    yield stack
    for runtime in stack.runtimes:
        await runtime.close()


async def test_an_autoscaler_started_from_its_snapshot_holds_what_folding_everything_holds(
        platform: Platform) -> None:
    first = await platform.start()
    for index in range(3):
        await platform.queued(index)
    await platform.settled(first)
    await platform.decides(first, InstanceRequested(instance="gpu-a", instance_type="gpu", provider="local",
                                                    jobs=[job(0)]),
                           InstanceRequested(instance="gpu-b", instance_type="gpu", provider="local", jobs=[job(1)]))
    await platform.decides(first, InstanceLaunched(instance="gpu-a", provider_id="i-a"),
                           InstanceLaunched(instance="gpu-b", provider_id="i-b"))
    await platform.registers("gpu-a")  # its readiness is the autoscaler's reaction
    await platform.ready(first, "gpu-a")
    await platform.runs(0, "gpu-a")
    await platform.records("job", job(0), JobSucceeded(job_id=job(0)))
    await platform.decides(first, InstanceReleased(instance="gpu-a", reason="idle"))
    await platform.records("node", "gpu-a", NodeRetired(node_name="gpu-a", reason="released"))  # the monitor's
    await platform.records("job", job(0), JobArchived(job_id=job(0), retention="1h"))
    await platform.settled(first)
    assert "gpu-a" not in first.state.instances  # ended, and the only job it was asked for archived
    assert await eventually(first.take_snapshot, WAIT)

    # After the snapshot: gpu-b is ready, its job runs, another is queued.
    await platform.registers("gpu-b")
    await platform.ready(first, "gpu-b")
    await platform.runs(1, "gpu-b")
    await platform.queued(3)
    await platform.settled(first)
    await platform.stop(first)

    restoring = platform.unstarted()
    restored = await restoring.restore()
    assert restored.own_after and dict(restored.upstream_after)
    assert job(0) not in restoring.state.lifecycle.jobs and "gpu-a" not in restoring.state.instances
    assert restoring.state.instances["gpu-b"].ready_at is None  # not yet, as the snapshot was taken
    assert [type(e.event) for e in restoring.history] == [InstanceRequested, InstanceRequested, InstanceLaunched,
                                                          InstanceLaunched, InstanceReady, InstanceReleased]

    again = await platform.start()
    await platform.settled(again)
    assert again._upstream_after == restored.upstream_after
    assert again.state.instances["gpu-b"].ready_at is not None and job(1) in again.state.running
    await platform.stop(again)

    rebuilt = await platform.start(FoldingAll)
    await platform.settled(rebuilt)
    assert rebuilt._upstream_after == {}
    assert again.state.saved() == rebuilt.state.saved()
    assert list(again.history) == list(rebuilt.history)
    assert again.versions == rebuilt.versions
