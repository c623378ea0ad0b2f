"""Node credentials at the real monitor: only an agent holding a node credential for exactly its node
registers, and only its credentialed heartbeats keep it alive and report its health."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.agent import NodeAgent
from libs.auth import bearer_headers, issue_node_token, issue_token
from libs.contracts import subjects
from libs.contracts.agent import Heartbeat, NodeAccepted, RegisterNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.events import Event, NodeLost, NodeRegistered, NodeUnhealthy
from libs.contracts.health import ComponentHealth
from libs.contracts.identity import Identity
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlVerifier
from libs.eventstore import EventStore
from libs.messaging.connection import round_trip
from libs.messaging.rpc import call
from libs.settings import Settings
from services.monitor.service import Monitor
from tests.support.monitor import start_monitor
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"
SECRET = "integration-tests-signing-secret-0123456789abcdef"
EVIL = NodeInfo(name="evil", address="127.0.0.1", cpus=64, memory_mib=262144)
NODE_A = NodeInfo(name="node-a", address="127.0.0.1", cpus=8, memory_mib=16384)
FAULTY = [ComponentHealth(kind="nic", name="eth0", healthy=False, detail="link down")]


@dataclasses.dataclass
class Running:
    monitor: Monitor
    log: EventStore

    async def recorded(self, kind: type[T] = Event) -> list[T]:  # type: ignore[assignment]
        return [e.event async for e in self.log.read_all() if isinstance(e.event, kind)]


@pytest_asyncio.fixture(loop_scope="session")
async def monitor(nats_url: str, database_url: str, make_store: StoreFactory) -> AsyncIterator[Running]:
    """The monitor in this process, quick to call a silent node lost."""
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, node_lost_seconds=1.0,
                        heartbeat_seconds=0.2)
    runtime, service = await start_monitor(settings)
    yield Running(service, await make_store("monitor"))
    await runtime.close()


async def register(nc: Client, info: NodeInfo, token: str | None) -> NodeAccepted | CommandError:
    reply: NodeAccepted | CommandError = await call(nc, REGISTER_NODE.subject, RegisterNode(node=info),
                                                    reply_type=NodeAccepted | CommandError, token=token)
    return reply


async def beat(nc: Client, node: str, token: str | None, health: list[ComponentHealth]) -> None:
    await nc.publish(subjects.heartbeat(node), encode(Heartbeat(node=node, sent_at=datetime.now(UTC), health=health)),
                     headers=bearer_headers(token) or None)
    await round_trip(nc)



USER = issue_token(SECRET, Identity(user="evil", admin=True))


@pytest.mark.parametrize(("token", "code", "message"), [
    (None, "unauthenticated", "carries no node credential"),
    (USER, "unauthenticated", "not a node credential"),
    (issue_node_token(SECRET, "evil", ttl_seconds=-5), "unauthenticated", "expired"),
    (issue_node_token("a-guessed-secret-of-enough-length-to-sign-0000", "evil"), "unauthenticated", "not valid"),
    (issue_node_token(SECRET, "node-a"), "forbidden", "for node node-a, not evil"),
])
async def test_a_registration_without_the_nodes_own_credential_is_refused_and_records_nothing(
        monitor: Running, nc: Client, token: str | None, code: str, message: str) -> None:
    reply = await register(nc, EVIL, token)
    assert isinstance(reply, CommandError)
    assert reply.code == code and message in reply.message
    assert "trainyard admin node-token evil" in (reply.hint or "")
    # And its heartbeats, credentialed or not, do not make it a node.
    await beat(nc, "evil", issue_node_token(SECRET, "evil"), [])
    await asyncio.sleep(0.3)
    assert await monitor.recorded() == []
    assert "evil" not in monitor.monitor.state.nodes


async def test_the_nodes_own_credential_registers_it(monitor: Running, nc: Client) -> None:
    reply = await register(nc, NODE_A, issue_node_token(SECRET, "node-a"))
    assert isinstance(reply, NodeAccepted)
    [registered] = await monitor.recorded(NodeRegistered)
    assert registered.node == NODE_A


async def test_heartbeats_without_the_nodes_credential_neither_keep_it_alive_nor_change_its_health(
        monitor: Running, nc: Client) -> None:
    credential = issue_node_token(SECRET, "node-a")
    assert isinstance(await register(nc, NODE_A, credential), NodeAccepted)
    others = (None, USER, issue_node_token(SECRET, "node-b"))
    # A second of beats with the wrong credentials, reporting a fault: the node is lost, never unhealthy.
    for _ in range(8):
        for token in others:
            await beat(nc, "node-a", token, FAULTY)
        await asyncio.sleep(0.2)
    await eventually(lambda: monitor.recorded(NodeLost))
    assert await monitor.recorded(NodeUnhealthy) == []
    # The node's own credential does carry its health.
    await beat(nc, "node-a", credential, FAULTY)
    [unhealthy] = await eventually(lambda: monitor.recorded(NodeUnhealthy))
    assert unhealthy.problems == ["nic:eth0 faulty (link down)"]


def agent(nats_url: str, name: str, home: Path, token: str | None) -> NodeAgent:
    return NodeAgent(NodeInfo(name=name, address="127.0.0.1", cpus=1, memory_mib=256), nats_url=nats_url,
                     root=home / "agents" / name, storage=home / "storage", health_probe_seconds=0.2,
                     node_token=token, control=ControlVerifier.of_secret(SECRET))


async def test_a_real_agent_with_its_credential_registers_and_without_one_exits_saying_why(
        monitor: Running, nats_url: str, tmp_path: Path) -> None:
    (tmp_path / "storage").mkdir()
    good = agent(nats_url, "node-a", tmp_path, issue_node_token(SECRET, "node-a"))
    try:
        await good.start()
        assert [e.node.name for e in await monitor.recorded(NodeRegistered)] == ["node-a"]
    finally:
        await good.close()

    for token in (None, issue_node_token(SECRET, "node-a")):
        stranger = agent(nats_url, "node-b", tmp_path, token)
        with pytest.raises(SystemExit) as refused:
            await stranger.start()
        with contextlib.suppress(Exception):
            await stranger.close()
        assert str(refused.value).startswith("the monitor refused node node-b: ")
        assert "ask an administrator for a node credential: trainyard admin node-token node-b" in str(refused.value)
    assert [e.node.name for e in await monitor.recorded(NodeRegistered)] == ["node-a"]


async def test_a_monitor_that_lost_its_history_gets_the_running_nodes_back(
        nats_url: str, database_url: str, nc: Client, tmp_path: Path, make_store: StoreFactory) -> None:
    """Agents register at their own start; a monitor that starts with nothing of them in its log (a new
    database) asks them to register again, at its start and when it hears one it does not know."""
    async def accept(msg: Msg) -> None:  # whatever answered before: the node is registered and runs
        await msg.respond(encode(NodeAccepted(heartbeat_seconds=0.2)))

    (tmp_path / "storage").mkdir()
    stand_in = await nc.subscribe(REGISTER_NODE.subject, cb=accept)
    running = agent(nats_url, "node-a", tmp_path, issue_node_token(SECRET, "node-a"))
    await running.start()
    await stand_in.unsubscribe()
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, node_lost_seconds=30,
                        heartbeat_seconds=0.2)
    runtime, _ = await start_monitor(settings)
    log = await make_store("monitor")
    try:
        async with asyncio.timeout(20):
            while not [e async for e in log.read_all() if isinstance(e.event, NodeRegistered)]:
                await asyncio.sleep(0.1)
    finally:
        await runtime.close()
        await running.close()
