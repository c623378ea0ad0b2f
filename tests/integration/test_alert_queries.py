"""People read alerts through the monitor (M7, J2): `ListAlerts` on real NATS and PostgreSQL.

The monitor raises the alerts itself: a node alert from an administrator's component mark, job
alerts from the scheduler's events (a checkpoint-resume job that failed), appended to a "scheduler"
event store and published by its outbox relay as the scheduler would.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.auth import bearer_headers, issue_node_token, issue_token
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.cluster import ClusterConfig, NodeInfo
from libs.contracts.codec import decode_any
from libs.contracts.events import AlertRaised, Event, EventEnvelope, JobFailed, JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cluster import MARK_COMPONENT, MarkComponent
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.rpc import ServiceUnavailable, call
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.monitor.service import Monitor
from tests.support.stores import StoreFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"
SECRET = "integration-tests-signing-secret-0123456789abcdef"
OWN, OTHER = "job-0000000000a1", "job-0000000000b2"


def token(user: str, *projects: str, admin: bool = False) -> str:
    return issue_token(SECRET, Identity(user=user, projects=list(projects or ["default"]), admin=admin))


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 30) -> T:
    async with asyncio.timeout(timeout):
        while not (value := await check()):
            await asyncio.sleep(0.1)
    return value


class Alerting:
    """The monitor in this process, the scheduler's log it follows, and clients logged in as people."""

    def __init__(self, nats_url: str, nc: Client, scheduler: EventStore, monitor_log: EventStore) -> None:
        self.nats_url = nats_url
        self.nc = nc
        self.scheduler = scheduler
        self.relay = OutboxRelay(scheduler, nc.jetstream())
        self.monitor_log = monitor_log
        self.runtime: ServiceRuntime | None = None
        self.clients: list[TrainyardClient] = []

    async def start(self, database_url: str) -> None:
        settings = Settings(nats_url=self.nats_url, database_url=database_url, auth_secret=SECRET,
                            smtp_url=None, alert_emails=("ops@example.com",), node_lost_seconds=3600)
        self.runtime = ServiceRuntime("monitor", settings)
        await self.runtime.start()
        monitor = Monitor(self.runtime, ClusterConfig.load(CLUSTER))
        await monitor.start()
        await self.runtime.listen()
        await monitor.caught_up()

    async def client(self, user: str, *projects: str, admin: bool = False) -> TrainyardClient:
        opened = await TrainyardClient.open(self.nats_url, token=token(user, *projects, admin=admin))
        self.clients.append(opened)
        return opened

    async def close(self) -> None:
        for opened in self.clients:
            await opened.close()
        if self.runtime is not None:
            await self.runtime.close()

    async def alerts_raised(self) -> list[str]:
        return [e.aggregate_id async for e in self.monitor_log.read_all() if isinstance(e.event, AlertRaised)]

    async def raise_node_alert(self, node: str) -> None:
        """Register the node, then an administrator marks one of its boards faulty: one node alert."""
        info = NodeInfo(name=node, address="127.0.0.1", cpus=8, memory_mib=16384)
        accepted = await call(self.nc, REGISTER_NODE.subject, RegisterNode(node=info),
                              reply_type=NodeAccepted | CommandError, token=issue_node_token(SECRET, node))
        assert isinstance(accepted, NodeAccepted)
        marked = await call(self.nc, MARK_COMPONENT.subject, MarkComponent(node=node, component="board:0"),
                            reply_type=Done | CommandError, token=token("root", admin=True))
        assert isinstance(marked, Done)

    async def raise_job_alert(self, job_id: str, creator: str, project: str) -> None:
        """The scheduler records a checkpoint-resume job of `project` that failed: one job alert."""
        spec = JobSpec(name=job_id, flavors=["cpu-2"], pool="resilient", algorithm=AlgorithmRef(name="algo"),
                       command="python3 train.py", output=OutputRef(name="out"), project=project,
                       access="read-only", checkpoint_resume=CheckpointResume(max_resumes=2))
        events: list[Event] = [JobSubmitted(job_id=job_id, spec=spec, creator=creator, creator_email=None),
                  JobFailed(job_id=job_id, reason="exit code 1", exit_code=1)]
        await self.scheduler.append([NewEvent("job", job_id, e) for e in events],
                                    expected_versions={("job", job_id): 0})
        while await self.relay.publish_pending():
            pass


@pytest_asyncio.fixture(loop_scope="session")
async def alerting(nats_url: str, nc: Client, make_store: StoreFactory) -> AsyncIterator[Alerting]:
    platform = Alerting(nats_url, nc, await make_store("scheduler"), await make_store("monitor"))
    yield platform
    await platform.close()


async def listed(client: TrainyardClient) -> list[EventEnvelope]:
    return [envelope async for envelope in client.alerts()]


async def test_alerts_come_back_through_the_monitor_in_order_page_by_page_for_those_who_may_see_them(
        alerting: Alerting, database_url: str, nc: Client) -> None:
    admin = await alerting.client("root", admin=True)
    alice = await alerting.client("alice", "vision")
    with pytest.raises(ServiceUnavailable, match="monitor"):  # nothing answers yet
        await listed(admin)

    await alerting.start(database_url)
    steps = [alerting.raise_node_alert("node-a"), alerting.raise_job_alert(OWN, "alice", "vision"),
             alerting.raise_job_alert(OTHER, "carol", "nlp")]
    for count, step in enumerate(steps, start=1):  # one at a time: the order they are raised in is known
        await step
        await eventually(functools.partial(_raised_at_least, alerting, count))
    expected = await alerting.alerts_raised()
    node_alert, own_alert, other_alert = expected
    assert node_alert.startswith("node-unhealthy-node-a-")
    assert (own_alert, other_alert) == (f"job-failed-{OWN}", f"job-failed-{OTHER}")

    everything = await listed(admin)
    assert [e.aggregate_id for e in everything] == expected
    assert all(isinstance(e.event, AlertRaised) for e in everything)
    assert [e.position for e in everything] == sorted(e.position for e in everything)

    # One alert per page: each page goes on where the last one ended, the last says there is no more.
    pages: list[AlertPage] = []
    after = 0
    while not pages or pages[-1].more:
        pages.append(await call(nc, LIST_ALERTS.subject, ListAlerts(after=after, limit=1),
                                reply_type=AlertPage, token=token("root", admin=True)))
        after = pages[-1].next_after
    assert [len(p.alerts) for p in pages] == [1, 1, 1]
    assert [e for p in pages for e in p.alerts] == everything
    assert pages[-1].next_after == everything[-1].position

    # Alice sees the node alert and her own job's, not the other project's job alert.
    assert [e.aggregate_id for e in await listed(alice)] == [node_alert, own_alert]
    carol = await alerting.client("carol", "nlp")
    assert [e.aggregate_id for e in await listed(carol)] == [node_alert, other_alert]

    anonymous = await call(nc, LIST_ALERTS.subject, ListAlerts(), reply_type=AlertPage | CommandError)
    assert isinstance(anonymous, CommandError) and anonymous.code == "unauthenticated"
    too_many = await nc.request(LIST_ALERTS.subject, b'{"type": "ListAlerts.v1", "limit": 1000000}',
                                headers=bearer_headers(token("root", admin=True)))
    refused = decode_any(too_many.data, AlertPage | CommandError)
    assert isinstance(refused, CommandError) and refused.code == "invalid-request" and "limit" in refused.message


async def _raised_at_least(alerting: Alerting, count: int) -> bool:
    return len(await alerting.alerts_raised()) >= count
