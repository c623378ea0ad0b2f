"""A launcher started from a snapshot of its live state, on real NATS and PostgreSQL: it holds what one that folds its
whole log and replays every stream holds, once it has folded the rest; the jobs archived before the snapshot are
never folded again; a snapshot it cannot take as it is (another code's, unreadable, of a stream made anew since) is
passed over for the log.

The scheduler's side is its log published by its own relay; the agents answer every request and report their
processes on the agents' reports stream, as theirs do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.agent import ProcessAccepted, ProcessExited, ProcessStarted, StartProcesses, StartsAnswered, Stopped
from libs.contracts.codec import decode, encode
from libs.contracts.events import (
    Event,
    JobAdmitted,
    JobArchived,
    JobFailed,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    LaunchPlanned,
    LaunchSucceeded,
    NodeProcessStarted,
    Placement,
)
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.connection import round_trip
from libs.settings import Settings
from libs.skeleton import snapshots
from libs.skeleton.eventsourced import Restored
from libs.skeleton.runtime import ServiceRuntime
from services.launcher.service import Launcher
from services.launcher.state import LauncherState, SavedLauncherState
from tests.support.platform import CLUSTER, plain_spec
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET = "integration-tests-signing-secret-0123456789abcdef"
WAIT = 30.0


def job(index: int) -> str:
    return f"job-{index:012x}"


def node(index: int) -> str:
    return f"node-{index % 2}"


class FoldingAll(Launcher):
    """A launcher that takes no snapshot and folds its whole log and every stream from the first message."""

    snapshot_code = ()


class Site:
    """The scheduler's log and relay, the agents, and the launchers started on them."""

    def __init__(self, nc: Client, scheduler: EventStore, launcher_log: EventStore, settings: Settings) -> None:
        self.nc = nc
        self.scheduler = scheduler
        self.launcher_log = launcher_log
        self.settings = settings
        self.relay = OutboxRelay(scheduler, nc.jetstream())
        self.versions: dict[str, int] = {}
        self.runtimes: list[ServiceRuntime] = []

    async def agents(self) -> None:
        """Every agent answers: processes accepted, stops done (the jobs here need no rendezvous ports)."""
        async def started(msg: Msg) -> None:
            starts = decode(msg.data, StartProcesses).starts
            await msg.respond(encode(StartsAnswered(answers=[ProcessAccepted(already_known=False)] * len(starts))))

        async def stopped(msg: Msg) -> None:
            await msg.respond(encode(Stopped(stopped=1)))

        await self.nc.subscribe(subjects.agent_starts("*"), cb=started)
        await self.nc.subscribe(subjects.agent_stop("*"), cb=stopped)
        await round_trip(self.nc)

    def launcher(self) -> Launcher:
        """A launcher on the test's connections, not started."""
        runtime = SimpleNamespace(store=self.launcher_log, js=self.nc.jetstream(), settings=self.settings)
        return Launcher(cast(ServiceRuntime, runtime), CLUSTER)

    async def records(self, job_id: str, *events: Event) -> None:
        """The scheduler records the job's events and its relay publishes them."""
        version = self.versions.get(job_id, 0)
        await self.scheduler.append([NewEvent("job", job_id, event) for event in events],
                                    expected_versions={("job", job_id): version})
        self.versions[job_id] = version + len(events)
        while await self.relay.publish_pending():
            pass

    async def admitted(self, index: int) -> None:
        placement = [Placement(rank=0, node=node(index), address="127.0.0.1", slots=1)]
        await self.records(job(index), JobSubmitted(job_id=job(index), spec=plain_spec(1), creator="alice"),
                           JobAdmitted(job_id=job(index), attempt=1, flavor="cpu-4", placement=placement))

    async def report(self, report: ProcessStarted | ProcessExited) -> None:
        await self.nc.jetstream().publish(subjects.agent_report(report.node), encode(report))

    async def started(self, index: int) -> None:
        await self.report(ProcessStarted(job_id=job(index), attempt=1, rank=0, node=node(index), pid=100 + index))

    async def exited(self, index: int, code: int) -> None:
        await self.report(ProcessExited(job_id=job(index), attempt=1, rank=0, node=node(index), exit_code=code,
                                        exited_at=datetime.now(UTC)))

    async def recorded(self, kind: type, job_ids: list[str]) -> None:
        """Wait until the launcher recorded a `kind` for each of `job_ids`."""
        async def all_there() -> bool:
            found = {e.aggregate_id async for e in self.launcher_log.read_all() if isinstance(e.event, kind)}
            return set(job_ids) <= found

        await eventually(all_there, WAIT)

    async def start(self, kind: type[Launcher] = Launcher) -> Launcher:
        runtime = ServiceRuntime("launcher", self.settings)
        await runtime.start()
        self.runtimes.append(runtime)
        launcher = kind(runtime, CLUSTER)
        await launcher.start()
        await runtime.listen()
        await launcher.caught_up()
        return launcher

    async def stop(self, launcher: Launcher) -> None:
        runtime = launcher.rt
        await runtime.close()
        self.runtimes.remove(runtime)

    async def settled(self, launcher: Launcher) -> None:
        """Wait until the launcher's followers have handled every message their streams hold."""
        async def handled() -> bool:
            for follower in launcher.followers:
                if await follower.lag():
                    return False
            return True

        await eventually(handled, WAIT)
        await asyncio.sleep(0.3)  # a reaction under way is recorded

    async def close(self) -> None:
        for runtime in self.runtimes:
            await runtime.close()


@pytest.fixture
def quick_snapshots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(snapshots, "SNAPSHOT_EVENTS", 20)
    monkeypatch.setattr(snapshots, "CHECK_SECONDS", 0.05)
    yield


@pytest_asyncio.fixture(loop_scope="session")
async def site(nc: Client, nats_url: str, database_url: str, make_store: StoreFactory) -> AsyncIterator[Site]:
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, node_lost_seconds=3600)
    found = Site(nc, await make_store("scheduler"), await make_store("launcher"), settings)
    await found.agents()
    yield found
    await found.close()


def comparable(state: LauncherState) -> SavedLauncherState:
    """What the state holds, as a pass of the dispatcher leaves it (settled launches out of `unsettled`), without
    what only the dispatcher's next pass reads (`touched`), and `unsettled` in one order."""
    state.active()
    saved = msgspec.msgpack.decode(state.saved(), type=SavedLauncherState)
    return msgspec.structs.replace(saved, unsettled=sorted(saved.unsettled), touched=[])


async def saved_snapshots(store: EventStore) -> list[snapshots.Snapshot]:
    return await snapshots.StartSnapshots(store.pool, "launcher", Launcher.snapshot_format()).recent()


async def test_a_launcher_started_from_its_snapshot_holds_what_folding_everything_holds(
        quick_snapshots: None, site: Site) -> None:
    first = await site.start()
    for index in range(6):
        await site.admitted(index)
    await site.recorded(LaunchPlanned, [job(i) for i in range(6)])
    for index in range(6):
        await site.started(index)
    await site.recorded(NodeProcessStarted, [job(i) for i in range(6)])
    # Some 40 events and messages folded: the snapshot loop took one by itself.
    await eventually(lambda: saved_snapshots(site.launcher_log), WAIT)

    for index in range(4):
        await site.exited(index, 0)
    await site.recorded(LaunchSucceeded, [job(i) for i in range(4)])
    for index in range(4):
        await site.records(job(index), JobSucceeded(job_id=job(index)))
    for index in (0, 1):
        await site.records(job(index), JobArchived(job_id=job(index), retention="1h"))
    await site.admitted(6)
    await site.recorded(LaunchPlanned, [job(6)])
    await site.settled(first)
    assert await eventually(first.take_snapshot, WAIT)
    taken = (await saved_snapshots(site.launcher_log))[0]
    assert taken.own_after == await site.launcher_log.last_position()
    assert len(await saved_snapshots(site.launcher_log)) <= snapshots.KEPT_SNAPSHOTS

    # After the snapshot: two more archived, a failure, a new job.
    for index in (2, 3):
        await site.records(job(index), JobArchived(job_id=job(index), retention="1h"))
    await site.exited(4, 1)
    await site.recorded(LaunchFailed, [job(4)])
    await site.records(job(4), JobFailed(job_id=job(4), reason="exit 1"))
    await site.started(6)
    await site.admitted(7)
    await site.recorded(LaunchPlanned, [job(7)])
    await site.settled(first)
    await site.stop(first)

    # Its own log is folded after what the snapshot holds, and the jobs archived before are not folded again.
    latest = (await saved_snapshots(site.launcher_log))[0]
    restoring = site.launcher()
    restored = await restoring.restore()
    assert restored.own_after == latest.own_after >= taken.own_after and dict(restored.upstream_after)
    assert job(0) not in restoring.state.lifecycle.jobs and job(0) not in restoring.state.launches
    assert job(5) in restoring.state.launches

    again = await site.start()
    assert again._upstream_after == latest.upstream_after
    await site.settled(again)
    assert {job(i) for i in range(4)}.isdisjoint(again.state.lifecycle.jobs)
    await site.stop(again)

    rebuilt = await site.start(FoldingAll)
    await site.settled(rebuilt)
    assert rebuilt._upstream_after == {}
    assert comparable(again.state) == comparable(rebuilt.state)
    assert again.versions == rebuilt.versions


async def test_a_snapshot_it_cannot_take_as_it_is_is_passed_over_for_the_log(site: Site) -> None:
    first = await site.start()
    for index in range(3):
        await site.admitted(index)
    await site.recorded(LaunchPlanned, [job(i) for i in range(3)])
    await site.settled(first)
    assert await first.take_snapshot()
    await site.stop(first)
    pool, table = site.launcher_log.pool, "launcher.start_snapshots"
    assert (await site.launcher().restore()).own_after == await site.launcher_log.last_position()

    # Of a stream made anew since (another creation time): the log and the streams from their first message.
    streams = await pool.fetchval(f"SELECT streams FROM {table}")
    await pool.execute(f"UPDATE {table} SET streams = jsonb_set(streams, '{{TRAINYARD_EVENTS}}', '\"then\"')")
    assert await site.launcher().restore() == Restored()

    # Unreadable: passed over as well.
    await pool.execute(f"UPDATE {table} SET streams = $1, data = $2", streams, b"not zlib")
    assert await site.launcher().restore() == Restored()

    # Made by other code: not read.
    await pool.execute(f"UPDATE {table} SET format = 'other'")
    assert await saved_snapshots(site.launcher_log) == []
