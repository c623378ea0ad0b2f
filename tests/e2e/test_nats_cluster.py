"""The stack on a cluster of three NATS servers, every stream kept on all three: servers killed while jobs run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import msgspec
import pytest

from client.api import TrainyardClient
from devstack.natscluster import NatsCluster, published_events, stream_leader
from devstack.natslogins import service_login
from libs.contracts import subjects
from tests.support.specs import sleeper
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]
TEST_ALGORITHMS = Path(__file__).parent / "algorithms"
SERVICES = ("scheduler", "launcher", "monitor", "autoscaler")


async def events_leader(stack: Stack) -> str:
    leader, replicas = await stream_leader(stack.nats_url, service_login(stack.home, "scheduler"),
                                           subjects.EVENTS_STREAM)
    assert replicas == 3  # every server keeps the event history
    return leader


async def published_and_stored(stack: Stack, database_url: str) -> dict[str, tuple[int, int]]:
    """Per service: the events its stream holds, and those its log stored."""
    published = await published_events(stack.nats_url, service_login(stack.home, "scheduler"), list(SERVICES))
    db = await asyncpg.connect(database_url)
    try:
        return {service: (published[service], int(await db.fetchval(f"SELECT count(*) FROM {service}.events")))
                for service in SERVICES}
    finally:
        await db.close()


async def test_killing_a_server_then_the_streams_leader_fails_no_job_and_loses_no_event(
        tmp_path: Path, database_url: str) -> None:
    tmp_path.chmod(0o755)
    stack = Stack(tmp_path, None, database_url, connect=TrainyardClient.open, algorithms=TEST_ALGORITHMS,
                  nats_servers=3)
    cluster: NatsCluster | None = stack.nats_cluster
    assert cluster is not None
    try:
        api = await stack.up()
        jobs: list[str] = []

        async def submit(count: int) -> None:
            for index in range(count):
                spec = msgspec.structs.replace(sleeper(f"through-{len(jobs)}-{index}", seconds=0.5), flavors=["cpu-1"])
                jobs.append((await api.submit(spec)).job_id)

        await submit(10)
        # A server that does not lead the event history dies, and comes back on its own store.
        leader = await events_leader(stack)
        follower = next(i for i in range(cluster.size) if cluster.name(i) != leader)
        cluster.kill(follower)
        await submit(10)
        await asyncio.sleep(2)
        cluster.start(follower)
        await submit(10)
        # Then the leader itself: the others elect a new one, the clients move to a server still up.
        leader = await events_leader(stack)
        cluster.kill(cluster.index_of(leader))
        await submit(10)
        async with asyncio.timeout(90):  # the two left elect a new leader
            while await events_leader(stack) == leader:
                await asyncio.sleep(0.2)
        cluster.start(cluster.index_of(leader))
        await submit(10)

        ended = [await stack.wait_until(job_id, "ended", timeout=180) for job_id in jobs]
        assert [job.status for job in ended] == ["succeeded"] * len(jobs), [job.reason for job in ended]
        # Every event a service stored is in the stream, once (each published with its id; repeats dropped).
        async with asyncio.timeout(60):
            while True:
                counts = await published_and_stored(stack, database_url)
                if all(published == stored for published, stored in counts.values()):
                    break
                await asyncio.sleep(1)
        assert all(counts[service][1] > 0 for service in ("scheduler", "launcher", "monitor"))
    finally:
        await stack.close()
        print(stack.dump_logs())
