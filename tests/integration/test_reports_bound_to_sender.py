"""Reports bound to their sender, on a real nats-server enforcing the shipped roles and real PostgreSQL: a node
agent logged in with node-b's credential cannot end, start or speak for node-a's processes or cache. What NATS
refuses never arrives; what node-b may publish but names another node's work (an exit report of the rank the
plan put on node-a, a cache report naming node-a) is set aside by the launcher and the monitor, and alerted.

The launcher and the monitor run in this process with their own NATS passwords (the monitor answers the auth
callout, as it does in the stack); the scheduler's side is its log published by its own relay and login."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import TypeVar

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig

from devstack.natslogins import nats_login_env
from libs.contracts import subjects
from libs.contracts.agent import (
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    StartProcesses,
    StartsAnswered,
    UsageSample,
)
from libs.contracts.codec import decode, encode
from libs.contracts.datacache import CacheReport
from libs.contracts.events import (
    AlertRaised,
    JobAdmitted,
    JobSubmitted,
    LaunchFailed,
    LaunchPlanned,
    NodeProcessExited,
    NodeProcessStarted,
    Placement,
    UpstreamMessageSetAside,
)
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.connection import STREAMS, round_trip
from libs.natsauth import ISSUER_SEED_FILE_VARIABLE
from libs.natsroles import STREAM_OWNERS
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.launcher.service import Launcher
from tests.support.monitor import start_monitor
from tests.support.platform import CLUSTER, JOB, plain_spec
from tests.support.roles_server import Conn, RolesServer, logins_folder, roles_server
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
SECRET = "integration-tests-signing-secret-0123456789abcdef"
WAIT_SECONDS = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolesServer]:
    home = tmp_path_factory.mktemp("nats-senders")
    with roles_server(home) as url:
        yield RolesServer(url, logins_folder(home), SECRET)


class Stack:
    """The launcher and the monitor on the permissioned server, the scheduler's log, and node agents."""

    def __init__(self, server: RolesServer, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = server
        self.monkeypatch = monkeypatch
        self.settings = Settings(nats_url=server.url, database_url=database_url, auth_secret=SECRET,
                                 node_lost_seconds=3600)
        self.runtimes: list[ServiceRuntime] = []
        self.connections: list[Client] = []
        self.launcher: Launcher | None = None
        self.versions: dict[str, int] = {}

    async def connect(self, role: str) -> Conn:
        """A connection logged in as `role` (libs/natsroles.py), closed with the stack."""
        conn = await self.server.connect(self.server.login(role))
        self.connections.append(conn.nc)
        return conn

    async def as_service(self, service: str) -> Client:
        return (await self.connect(service)).nc

    async def declare_streams(self) -> None:
        """What each owner's `ensure_streams` declares (the scheduler's, whose service does not run here)."""
        for config in STREAMS:
            assert config.name is not None
            owner = await self.as_service(STREAM_OWNERS[config.name])
            await owner.jetstream().add_stream(config)
        scheduler = await self.as_service("scheduler")
        await scheduler.jetstream().create_key_value(KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1))

    def _logged_in_as(self, service: str) -> None:
        for name, value in nats_login_env(self.server.folder.parent, service).items():
            self.monkeypatch.setenv(name, value)

    async def start(self) -> None:
        self._logged_in_as("monitor")  # with the issuer key: it answers the agents' logins
        runtime, _ = await start_monitor(self.settings)
        self.runtimes.append(runtime)
        self._logged_in_as("launcher")
        self.monkeypatch.delenv(ISSUER_SEED_FILE_VARIABLE, raising=False)
        runtime = ServiceRuntime("launcher", self.settings)
        await runtime.start()
        self.launcher = Launcher(runtime, CLUSTER)
        await self.launcher.start()
        await runtime.listen()
        await self.launcher.caught_up()
        self.runtimes.append(runtime)

    async def agent(self, node: str) -> Conn:
        """An agent of `node`: it accepts every start the launcher sends it."""
        conn = await self.connect(f"agent-{node}")  # logged in with its node credential

        async def accept(msg: Msg) -> None:
            starts = decode(msg.data, StartProcesses).starts
            await msg.respond(encode(StartsAnswered(answers=[ProcessAccepted(already_known=False)] * len(starts))))

        await conn.nc.subscribe(subjects.agent_starts(node), cb=accept)
        await round_trip(conn.nc)
        return conn

    async def close(self) -> None:
        for nc in self.connections:
            await nc.close()
        for runtime in reversed(self.runtimes):
            await runtime.close()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(server: RolesServer, database_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    found = Stack(server, database_url, monkeypatch)
    await found.declare_streams()
    yield found
    await found.close()


async def scheduler_admits(stack: Stack, store: EventStore, placement: list[Placement]) -> None:
    """The scheduler's log of the job, published by its own relay and login, as the scheduler does."""
    await store.append([NewEvent("job", JOB, JobSubmitted(job_id=JOB, spec=plain_spec(len(placement)),
                                                          creator="alice")),
                        NewEvent("job", JOB, JobAdmitted(job_id=JOB, attempt=1, flavor="cpu-4", placement=placement))],
                       expected_versions={("job", JOB): 0})
    relay = OutboxRelay(store, (await stack.as_service("scheduler")).jetstream())
    while await relay.publish_pending():
        pass


async def of(store: EventStore, kind: type[T]) -> list[T]:
    return [e.event async for e in store.read_all() if isinstance(e.event, kind)]


async def at_least(store: EventStore, kind: type[T], count: int) -> list[T]:
    found = await of(store, kind)
    return found if len(found) >= count else []


def exited(rank: int, node: str, code: int) -> ProcessExited:
    return ProcessExited(job_id=JOB, attempt=1, rank=rank, node=node, exit_code=code, exited_at=datetime.now(UTC))


async def test_a_node_cannot_end_start_or_speak_for_another_nodes_processes_or_cache(
        stack: Stack, make_store: StoreFactory) -> None:
    await stack.start()
    scheduler, launcher_log, monitor_log = (await make_store("scheduler"), await make_store("launcher"),
                                            await make_store("monitor"))
    node_a, node_b = await stack.agent("node-a"), await stack.agent("node-b")
    placement = [Placement(rank=0, node="node-a", address="127.0.0.1", slots=1),
                 Placement(rank=1, node="node-b", address="127.0.0.1", slots=1)]
    await scheduler_admits(stack, scheduler, placement)
    await eventually(lambda: at_least(launcher_log, LaunchPlanned, 1), WAIT_SECONDS)
    for agent, rank, node in ((node_a, 0, "node-a"), (node_b, 1, "node-b")):
        await agent.nc.jetstream().publish(subjects.agent_report(node), encode(ProcessStarted(
            job_id=JOB, attempt=1, rank=rank, node=node, pid=100 + rank)), timeout=WAIT_SECONDS)
    await eventually(lambda: at_least(launcher_log, NodeProcessStarted, 2), WAIT_SECONDS)
    js_b = node_b.nc.jetstream()

    # On node-a's subjects node-b publishes nothing: NATS refuses it (no acknowledgement comes).
    for subject in (subjects.agent_report("node-a"), subjects.agent_cache("node-a"),
                    subjects.node_logs(JOB, 0, "node-a")):
        with pytest.raises(Exception):  # noqa: B017 - the server drops it
            await js_b.publish(subject, encode(exited(0, "node-a", 137)), timeout=1)
        assert await node_b.refused("publish", subject)
    usage = await js_b.key_value(subjects.USAGE_BUCKET)
    sample = UsageSample(job_id=JOB, attempt=1, rank=0, node="node-a", cpu_percent=0.0, memory_mib=1, processes=1,
                         sampled_at=datetime.now(UTC))
    with pytest.raises(Exception):  # noqa: B017
        await usage.put(subjects.usage_key(JOB, 1, 0, "node-a"), encode(sample))
    assert await node_b.refused("publish", f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key(JOB, 1, 0, 'node-a')}")

    # On its own subject, node-b ends rank 0 (node-a's) naming node-a, then naming itself; and reports node-a's
    # cache. Each is set aside, once, and alerted.
    await js_b.publish(subjects.agent_report("node-b"), encode(exited(0, "node-a", 137)), timeout=WAIT_SECONDS)
    await js_b.publish(subjects.agent_report("node-b"), encode(exited(0, "node-b", 137)), timeout=WAIT_SECONDS)
    cache = CacheReport(node="node-a", sent_at=datetime.now(UTC), entries=[])
    await js_b.publish(subjects.agent_cache("node-b"), encode(cache), timeout=WAIT_SECONDS)

    refused = await eventually(lambda: at_least(launcher_log, UpstreamMessageSetAside, 2), WAIT_SECONDS)
    assert [(r.consumer, r.cause, r.subject) for r in refused] == [
        ("agent-reports", "inconsistent", subjects.agent_report("node-b"))] * 2
    assert "names node node-a" in refused[0].reason
    assert "which runs on node-a" in refused[1].reason
    [cache_refused] = await eventually(lambda: at_least(monitor_log, UpstreamMessageSetAside, 1), WAIT_SECONDS)
    assert (cache_refused.consumer, cache_refused.cause) == ("cache-reports", "inconsistent")
    alerts = await eventually(lambda: at_least(monitor_log, AlertRaised, 3), WAIT_SECONDS)
    assert sorted(a.kind for a in alerts) == ["message-set-aside"] * 3

    # The job runs on: nothing of the forgeries was recorded, and the real exit of rank 0 still is.
    assert await of(launcher_log, NodeProcessExited) == []
    assert await of(launcher_log, LaunchFailed) == []
    assert stack.launcher is not None and stack.launcher.state.launches[JOB].outcome is None
    await node_a.nc.jetstream().publish(subjects.agent_report("node-a"), encode(exited(0, "node-a", 0)),
                                        timeout=WAIT_SECONDS)
    [real] = await eventually(lambda: at_least(launcher_log, NodeProcessExited, 1), WAIT_SECONDS)
    assert (real.rank, real.node, real.exit_code) == (0, "node-a", 0)
    assert len(await of(launcher_log, UpstreamMessageSetAside)) == 2
