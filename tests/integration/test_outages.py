"""NATS going away and coming back is weathered, not propagated: a monitor cut off from NATS does not
count its own deafness against the nodes, and answers again once NATS is back; a job writes on while
its agent cannot ship its log, and the log and its exit arrive afterwards. Against a NATS server of
the test's own, killed with SIGKILL and started again on the same port and store."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.agent import NodeAgent
from agent.isolation.workspace import BACKEND_VARIABLE, PLAIN
from client.api import TrainyardClient, TrainyardError
from devstack.servers import admin_url, create_database, free_port, nats_server_binary, start_postgres, wait_for_port
from libs.auth import bearer_headers, issue_node_token, issue_token
from libs.contracts import subjects
from libs.contracts.agent import (
    Heartbeat,
    LogChunk,
    NodeAccepted,
    ProcessAccepted,
    ProcessExited,
    ProcessReport,
    RegisterNode,
    StartProcess,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode_any, encode
from libs.contracts.events import NodeLaunch, NodeLost, NodeRegistered
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import SUBMIT_JOB, JobAccepted, SubmitJob
from libs.eventstore import EventStore
from libs.messaging.connection import ensure_streams
from libs.messaging.reader import read_subject
from libs.messaging.rpc import ServiceUnavailable, call
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.scheduler.service import Scheduler
from tests.support.agents import LAUNCHER, start_agent
from tests.support.monitor import CLUSTER, start_monitor
from tests.support.own_nats import OwnNats
from tests.support.postgres import crash_postgres, private_postgres
from tests.support.specs import sleeper

pytestmark = pytest.mark.asyncio(loop_scope="session")

SECRET = "outage-tests-signing-secret-0123456789abcdef"
LOST_SECONDS = 2.0
OUTAGE_SECONDS = 3 * LOST_SECONDS


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    server = OwnNats(tmp_path / "nats")
    server.start()
    yield server
    with contextlib.suppress(Exception):
        server.kill()


@pytest_asyncio.fixture(loop_scope="session")
async def monitor(own_nats: OwnNats, database_url: str) -> AsyncIterator[ServiceRuntime]:
    nc = await nats.connect(own_nats.url)
    await ensure_streams(nc.jetstream())  # as the streams' owners would
    await nc.close()
    settings = Settings(nats_url=own_nats.url, database_url=database_url, auth_secret=SECRET,
                        node_lost_seconds=LOST_SECONDS, heartbeat_seconds=0.3)
    runtime, _ = await start_monitor(settings)
    yield runtime
    await runtime.close()


async def beat_forever(url: str, node: str) -> None:
    """A node agent's heartbeats, on a connection that reconnects like the agent's."""
    credential = issue_node_token(SECRET, node)
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        info = NodeInfo(name=node, address="127.0.0.1", cpus=4, memory_mib=8192)
        reply = await call(nc, REGISTER_NODE.subject, RegisterNode(node=info), token=credential,
                           reply_type=NodeAccepted | CommandError)
        assert isinstance(reply, NodeAccepted)
        while True:
            with contextlib.suppress(Exception):  # NATS is away: the next beat goes once it is back
                await nc.publish(subjects.heartbeat(node), encode(Heartbeat(node=node, sent_at=datetime.now(UTC))),
                                 headers=bearer_headers(credential))
            await asyncio.sleep(0.3)
    finally:
        await nc.close()


async def recorded(database_url: str, kind: type) -> list[object]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        return [e.event async for e in EventStore(pool, "monitor").read_all() if isinstance(e.event, kind)]
    finally:
        await pool.close()


async def test_a_nats_outage_loses_no_node_and_the_monitor_answers_again(
        own_nats: OwnNats, monitor: ServiceRuntime, database_url: str) -> None:
    beats = asyncio.create_task(beat_forever(own_nats.url, "node-a"))
    try:
        async with asyncio.timeout(30):
            while not await recorded(database_url, NodeRegistered):
                await asyncio.sleep(0.1)
        await asyncio.sleep(1)

        own_nats.kill()
        await asyncio.sleep(OUTAGE_SECONDS)  # far longer than a node may stay silent
        own_nats.start()
        await asyncio.sleep(3 * LOST_SECONDS)  # the monitor, back, hears the node again

        assert await recorded(database_url, NodeLost) == []
        nc = await nats.connect(own_nats.url)
        try:
            admin = issue_token(SECRET, Identity(user="root", projects=[], admin=True))
            async with asyncio.timeout(60):
                while True:
                    with contextlib.suppress(ServiceUnavailable):
                        page = await call(nc, LIST_ALERTS.subject, ListAlerts(), token=admin, timeout=2,
                                          reply_type=AlertPage | CommandError)
                        break
                    await asyncio.sleep(0.2)
            assert isinstance(page, AlertPage) and page.alerts == []
        finally:
            await nc.close()
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beats


async def test_a_node_silent_after_the_outage_is_still_lost(own_nats: OwnNats, monitor: ServiceRuntime,
                                                            database_url: str) -> None:
    beats = asyncio.create_task(beat_forever(own_nats.url, "node-a"))
    async with asyncio.timeout(30):
        while not await recorded(database_url, NodeRegistered):
            await asyncio.sleep(0.1)
    own_nats.kill()
    beats.cancel()  # the node does not come back with NATS
    with contextlib.suppress(asyncio.CancelledError):
        await beats
    await asyncio.sleep(OUTAGE_SECONDS)
    own_nats.start()

    async with asyncio.timeout(30):
        while not (lost := await recorded(database_url, NodeLost)):
            await asyncio.sleep(0.2)
    assert [e.node_name for e in lost] == ["node-a"]  # type: ignore[attr-defined]


# --- a node agent through a NATS outage ------------------------------------------------------------------

JOB = "job-0a7a6e000001"
LINES = 30_000


def chatty(flag: Path, done: Path, halfway: Path | None = None) -> str:
    """A job that waits for `flag`, then writes LINES lines (about 2 MB) over a second or so and leaves `done`
    behind; with `halfway`, it waits for that too once it wrote half of them."""
    pause = (f"    if i == {LINES // 2}:\n"
             f"        while not os.path.exists({str(halfway)!r}):\n            time.sleep(0.05)\n") if halfway else ""
    return (f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n"
            f"for i in range({LINES}):\n{pause}    print(f'line {{i}} ' + 'x' * 60)\n"
            f"    if i % 1000 == 999:\n        time.sleep(0.03)\n"
            f"open({str(done)!r}, 'w').close()\n")


@pytest_asyncio.fixture(loop_scope="session")
async def agent_on_own_nats(own_nats: OwnNats, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[NodeAgent, Client]]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await ensure_streams(nc.jetstream())

    async def accept(msg: Msg) -> None:  # the monitor's part of registration
        await msg.respond(encode(NodeAccepted(heartbeat_seconds=0.5)))

    await nc.subscribe(REGISTER_NODE.subject, cb=accept)
    agent = await start_agent(own_nats.url, "node-a", tmp_path)
    yield agent, nc
    await agent.close()
    await nc.close()


async def start_chatty(nc: Client, home: Path, halfway: Path | None = None) -> tuple[Path, Path]:
    """Start the chatty job on node-a; it writes once `flag` exists (and goes on past half its lines once `halfway`
    does), and leaves `done` when it has."""
    flag, done = home / "go", home / "done"
    launch = NodeLaunch(rank=0, node="node-a", address="127.0.0.1",
                        argv=[sys.executable, "-c", chatty(flag, done, halfway)], env={}, mounts=[])
    accepted = await call(nc, subjects.agent_start("node-a"), StartProcess(job_id=JOB, attempt=1, launch=launch),
                          reply_type=ProcessAccepted | CommandError, signer=LAUNCHER)
    assert accepted == ProcessAccepted(already_known=False)
    await asyncio.sleep(1)
    return flag, done


async def until_done(done: Path) -> None:
    async with asyncio.timeout(60):
        while not done.exists():
            await asyncio.sleep(0.1)


async def shipped(nc: Client) -> tuple[list[str], list[ProcessExited]]:
    """Once the job's exit was reported: its lines in the log stream, and its exit reports."""
    js = nc.jetstream()
    async with asyncio.timeout(60):
        while True:
            exits = [r async for m in read_subject(js, subjects.AGENT_REPORTS_STREAM, subjects.agent_report("node-a"))
                     if isinstance(r := decode_any(m.data, ProcessReport), ProcessExited)]
            if exits:
                break
            await asyncio.sleep(0.5)
    lines = [line async for m in read_subject(js, subjects.LOGS_STREAM, subjects.job_logs(JOB, 0))
             for line in decode_any(m.data, LogChunk).lines]
    return lines, exits


async def test_a_job_writes_on_through_a_nats_outage_and_its_log_and_exit_arrive_after(
        own_nats: OwnNats, agent_on_own_nats: tuple[NodeAgent, Client], tmp_path: Path) -> None:
    _, nc = agent_on_own_nats
    flag, done = await start_chatty(nc, tmp_path)

    own_nats.kill()
    flag.touch()
    await until_done(done)  # the job is not held up by a log nobody can take
    await asyncio.sleep(1)
    own_nats.start()
    lines, exits = await shipped(nc)

    assert [e.exit_code for e in exits] == [0]
    assert lines == [f"line {i} " + "x" * 60 for i in range(LINES)]


async def test_a_job_outlives_its_agent_and_the_next_agent_ships_its_log_once_and_reports_its_exit(
        own_nats: OwnNats, agent_on_own_nats: tuple[NodeAgent, Client], tmp_path: Path) -> None:
    first, nc = agent_on_own_nats
    halfway = tmp_path / "halfway"
    flag, done = await start_chatty(nc, tmp_path, halfway)

    flag.touch()
    await asyncio.sleep(0.3)  # the job is writing, and some of it is shipped
    await first.close()  # an agent stopped for an upgrade, in the middle of a shipment
    assert not done.exists()  # held at half its lines, however long the close took
    halfway.touch()
    await until_done(done)  # the job writes on without its agent
    second = await start_agent(own_nats.url, "node-a", tmp_path)  # adopts it
    try:
        lines, exits = await shipped(nc)
    finally:
        await second.close()

    assert [e.exit_code for e in exits] == [0]
    assert lines == [f"line {i} " + "x" * 60 for i in range(LINES)]  # every line once, in order


# --- a service through a PostgreSQL outage ------------------------------------------------------------------


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    with private_postgres(tmp_path) as server:
        yield server


async def test_the_scheduler_outlives_its_database_going_away_and_answers_honestly_meanwhile(
        own_postgres: tuple[Path, int], nats_url: str, tmp_path: Path) -> None:
    folder, port = own_postgres
    await create_database(admin_url(folder, port, "postgres", socket=False), "trainyard")
    (tmp_path / "storage" / "algorithms" / "sleeper").mkdir(parents=True)  # what the jobs name must exist
    settings = Settings(nats_url=nats_url, database_url=admin_url(folder, port, "trainyard", socket=False),
                        auth_secret=SECRET, cluster_config=CLUSTER, storage_root=tmp_path / "storage")
    runtime = ServiceRuntime("scheduler", settings)
    await runtime.start()
    scheduler = Scheduler.create(runtime)
    await scheduler.start()
    await runtime.listen()
    client = await TrainyardClient.open(nats_url, token=issue_token(SECRET, Identity(user="alice",
                                                                                     projects=["default"])))
    try:
        before = await client.submit(sleeper("before-the-outage"))

        crash_postgres(folder)
        # Queries are answered from memory; a command that must be recorded is refused, honestly.
        assert before.job_id in {job.job_id for job in await client.list_jobs()}
        meanwhile = await call(client.nc, SUBMIT_JOB.subject, SubmitJob(job_id=new_job_id(),
                                                                          spec=sleeper("during-the-outage")),
                               token=client.token, reply_type=JobAccepted | CommandError)
        await asyncio.sleep(3)  # the cycle and the lease meet the outage meanwhile
        start_postgres(folder, port)

        async with asyncio.timeout(30):
            while True:
                with contextlib.suppress(TrainyardError):
                    after = await client.submit(sleeper("after-the-outage"))
                    break
                await asyncio.sleep(0.5)
        listed = {job.job_id for job in await client.list_jobs()}
        stopped = asyncio.ensure_future(runtime.stopped())
        await asyncio.sleep(0.5)
        assert not stopped.done()  # nothing in the scheduler died of the outage
        stopped.cancel()
    finally:
        await client.close()
        await runtime.close()
    assert isinstance(meanwhile, CommandError) and meanwhile.code == "unavailable"
    assert "cannot reach its database or NATS right now" in meanwhile.message
    assert {before.job_id, after.job_id} <= listed


def nats_without_jetstream(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


async def test_a_service_started_while_jetstream_does_not_answer_starts_once_it_does(
        nats_url: str, database_url: str, tmp_path: Path) -> None:
    """NATS answers but its JetStream does not (a server started without it stands in for one that is busy or
    starting): the scheduler's start waits, undone and made again, without the process ending, and completes once
    a JetStream server is on the same port; then it takes jobs."""
    port = free_port()
    plain = nats_without_jetstream(port)
    (tmp_path / "storage" / "algorithms" / "sleeper").mkdir(parents=True)  # what the jobs name must exist
    settings = Settings(nats_url=f"nats://127.0.0.1:{port}", database_url=database_url, auth_secret=SECRET,
                        cluster_config=CLUSTER, storage_root=tmp_path / "storage")
    server = OwnNats(tmp_path / "nats")
    server.port, server.url = port, settings.nats_url
    try:
        wait_for_port(port, 15, "nats-server", tmp_path / "absent.log")
        starting = asyncio.ensure_future(Scheduler.started(settings))
        await asyncio.sleep(3)
        assert not starting.done()  # waiting, not failed
        plain.kill()
        plain.wait(timeout=10)
        server.start()
        runtime = await asyncio.wait_for(starting, 60)
        client = await TrainyardClient.open(settings.nats_url, token=issue_token(
            SECRET, Identity(user="alice", projects=["default"])))
        try:
            accepted = await client.submit(sleeper("after-jetstream-answers"))
            assert accepted.job_id in {job.job_id for job in await client.list_jobs()}
        finally:
            await client.close()
            await runtime.close()
    finally:
        plain.kill()
        server.kill()
