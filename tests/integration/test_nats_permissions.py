"""The roles NATS enforces, on a real nats-server started with the configuration the stack ships
(devstack/natslogins.py): services log in with their password, node agents and people with a
Trainyard token that the auth callout (libs/natsauth.py, served here as the scheduler serves it)
turns into their role's permissions. Each role can do what its code does on NATS, and is refused
what is not its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, KeyValueConfig, StreamConfig

from client.api import TrainyardClient, TrainyardError
from client.cli.runner import UNAUTHENTICATED_HINT, error_hint
from libs.auth import issue_job_token, issue_token, new_secret
from libs.contracts import subjects
from libs.contracts.identity import Identity
from libs.contracts.operations.jobs import LIST_JOBS, SUBMIT_JOB
from libs.messaging.connection import STREAMS, NatsLogin, round_trip
from libs.messaging.reader import read_subject
from libs.natsauth import serve
from libs.natsroles import MONITOR_LOGS_CONSUMER, STREAM_OWNERS, agent_user, inbox_prefix, job_inbox
from tests.support.roles_server import Conn, RolesServer, serving_roles

ALICE = "alice"  # a person, logged in with her user token as NATS user `user-alice`
WAIT_SECONDS = 30  # for what the server answers at once, on a machine that may be slow to get to it


Server = RolesServer
ConnectAs = Callable[[str], Awaitable[Conn]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("nats-roles")
    with serving_roles(home) as served:
        yield served


@pytest_asyncio.fixture
async def callout(server: Server) -> AsyncIterator[None]:
    """The scheduler's answer to the auth callout, on its own service login."""
    nc = await nats.connect(server.url, **server.login("scheduler").options())
    await serve(nc, seed=server.issuer_seed(), secret=server.secret, service="scheduler")
    await round_trip(nc)
    yield
    await nc.close()


@pytest_asyncio.fixture
async def connect(server: Server, callout: None) -> AsyncIterator[ConnectAs]:
    opened: list[Client] = []

    async def connect_as(user: str) -> Conn:
        conn = await server.connect(server.login(user))
        opened.append(conn.nc)
        return conn

    yield connect_as
    for nc in opened:
        await nc.close()


async def declare_owned_streams(connect_as: ConnectAs) -> None:
    """What each owner's `ensure_streams` would declare: the scheduler the events and the usage bucket,
    the launcher the agent reports, the monitor the logs."""
    for config in STREAMS:
        assert config.name is not None
        owner = await connect_as(STREAM_OWNERS[config.name])
        await owner.nc.jetstream().add_stream(config)
    scheduler = await connect_as("scheduler")
    await scheduler.nc.jetstream().create_key_value(KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1))


def test_nats_server_accepts_the_shipped_configuration(server: Server) -> None:
    assert server.url.startswith("nats://")  # the fixture ran `nats-server -t` and started the server


async def test_anonymous_and_wrong_password_connections_are_refused(server: Server, callout: None) -> None:
    for options in ({}, {"user": "scheduler", "password": "wrong"}, {"user": "alice", "password": "wrong"},
                    {"token": "not-a-token"}):
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=WAIT_SECONDS, **options)


async def test_a_client_with_a_refused_token_is_told_to_get_a_token_not_to_start_the_stack(
        server: Server, callout: None) -> None:
    with pytest.raises(TrainyardError) as refused:
        await TrainyardClient.open(server.url, token="not-a-token")

    assert refused.value.error.code == "unauthenticated"
    assert "refused the login" in refused.value.error.message
    assert error_hint(refused.value.error) == UNAUTHENTICATED_HINT


async def test_a_service_publishes_its_own_events_but_not_another_services(connect: ConnectAs) -> None:
    await declare_owned_streams(connect)
    launcher: Conn = await connect("launcher")
    js = launcher.nc.jetstream()
    own = subjects.event_subject("launcher", "launch", "LaunchSucceeded")
    ack = await js.publish(own, b"{}", timeout=WAIT_SECONDS)
    assert ack.stream == subjects.EVENTS_STREAM

    forged = subjects.event_subject("scheduler", "job", "JobSucceeded")
    with pytest.raises(Exception):  # noqa: B017 - the server drops it, so no acknowledgement comes
        await js.publish(forged, b"{}", timeout=1)
    assert await launcher.refused("publish", forged)
    # Read back through the launcher's own ordered consumer: only its event is stored.
    stored = [m.subject async for m in read_subject(js, subjects.EVENTS_STREAM, subjects.EVENTS_ALL)]
    assert stored == [own]


async def test_an_agent_reports_for_its_own_node_only(connect: ConnectAs) -> None:
    await declare_owned_streams(connect)
    agent: Conn = await connect(agent_user("node-a"))
    js = agent.nc.jetstream()
    ack = await js.publish(subjects.agent_report("node-a"), b"{}", timeout=WAIT_SECONDS)
    assert ack.stream == subjects.AGENT_REPORTS_STREAM
    with pytest.raises(Exception):  # noqa: B017
        await js.publish(subjects.agent_report("node-b"), b"{}", timeout=1)
    assert await agent.refused("publish", subjects.agent_report("node-b"))
    # A job's metrics, as its own node's only (R1).
    metrics = await js.publish(subjects.job_metrics("job-000000000002", "node-a"), b"{}", timeout=WAIT_SECONDS)
    assert metrics.stream == subjects.METRICS_STREAM
    with pytest.raises(Exception):  # noqa: B017
        await js.publish(subjects.job_metrics("job-000000000002", "node-b"), b"{}", timeout=1)
    assert await agent.refused("publish", subjects.job_metrics("job-000000000002", "node-b"))
    # Any job's log chunks and usage samples, as its own node's only.
    logs = await js.publish(subjects.node_logs("job-000000000002", 0, "node-a"), b"{}", timeout=WAIT_SECONDS)
    assert logs.stream == subjects.LOGS_STREAM
    with pytest.raises(Exception):  # noqa: B017
        await js.publish(subjects.node_logs("job-000000000002", 0, "node-b"), b"{}", timeout=1)
    assert await agent.refused("publish", subjects.node_logs("job-000000000002", 0, "node-b"))
    kv = await js.key_value(subjects.USAGE_BUCKET)
    await kv.put(subjects.usage_key("job-000000000002", 1, 0, "node-a"), b"{}")
    for key in (subjects.usage_key("job-000000000002", 1, 0, "node-b"), "job-000000000002.1.0"):
        with pytest.raises(Exception):  # noqa: B017
            await kv.put(key, b"{}")
        assert await agent.refused("publish", f"$KV.{subjects.USAGE_BUCKET}.{key}")


async def test_an_agent_answers_its_own_requests_and_cannot_listen_to_another_nodes(connect: ConnectAs) -> None:
    agent: Conn = await connect(agent_user("node-a"))
    launcher: Conn = await connect("launcher")
    overheard: list[Msg] = []

    async def answer(msg: Msg) -> None:
        await msg.respond(b"accepted")

    async def overhear(msg: Msg) -> None:
        overheard.append(msg)

    await agent.nc.subscribe(subjects.agent_start("node-a"), cb=answer)
    await agent.nc.subscribe(subjects.agent_start("node-b"), cb=overhear)
    await round_trip(agent.nc)
    assert await agent.refused("subscription", subjects.agent_start("node-b"))
    reply = await launcher.nc.request(subjects.agent_start("node-a"), b"{}", timeout=WAIT_SECONDS)
    assert reply.data == b"accepted"
    await launcher.nc.publish(subjects.agent_start("node-b"), b"{}")
    await round_trip(launcher.nc)
    await asyncio.sleep(0.2)
    assert overheard == []


@pytest.mark.parametrize("role", [agent_user("node-a"), ALICE])
async def test_agents_and_users_cannot_delete_purge_or_change_a_stream(connect: ConnectAs, role: str) -> None:
    await declare_owned_streams(connect)
    conn: Conn = await connect(role)
    js = conn.nc.jetstream(timeout=1)
    stream = subjects.AGENT_REPORTS_STREAM
    with pytest.raises(Exception):  # noqa: B017
        await js.delete_stream(stream)
    assert await conn.refused("publish", f"$JS.API.STREAM.DELETE.{stream}")
    with pytest.raises(Exception):  # noqa: B017
        await js.purge_stream(stream)
    assert await conn.refused("publish", f"$JS.API.STREAM.PURGE.{stream}")
    with pytest.raises(Exception):  # noqa: B017
        await js.update_stream(StreamConfig(name=stream, subjects=[">"]))
    assert await conn.refused("publish", f"$JS.API.STREAM.UPDATE.{stream}")
    launcher: Conn = await connect("launcher")
    info = await launcher.nc.jetstream().stream_info(stream)
    assert info.config.subjects == [subjects.AGENT_REPORTS_ALL]


async def test_a_user_sends_requests_but_reads_no_stream_and_starts_nothing(connect: ConnectAs) -> None:
    scheduler: Conn = await connect("scheduler")
    agent: Conn = await connect(agent_user("node-a"))
    alice: Conn = await connect(ALICE)
    starts: list[Msg] = []

    async def answer(msg: Msg) -> None:
        await msg.respond(b"accepted")

    async def on_start(msg: Msg) -> None:
        starts.append(msg)

    await scheduler.nc.subscribe(SUBMIT_JOB.subject, queue="trainyard-scheduler", cb=answer)
    await agent.nc.subscribe(subjects.agent_start("node-a"), cb=on_start)
    await round_trip(scheduler.nc)
    await round_trip(agent.nc)
    assert (await alice.nc.request(SUBMIT_JOB.subject, b"{}", timeout=WAIT_SECONDS)).data == b"accepted"

    for subject in (subjects.EVENTS_ALL, subjects.LOGS_ALL):
        await alice.nc.subscribe(subject)
        assert await alice.refused("subscription", subject)
    await alice.nc.publish(subjects.agent_start("node-a"), b"{}")
    assert await alice.refused("publish", subjects.agent_start("node-a"))
    await asyncio.sleep(0.2)
    assert starts == []


async def test_a_user_takes_part_in_her_own_debug_sessions_only(connect: ConnectAs) -> None:
    agent: Conn = await connect(agent_user("node-a"))
    alice: Conn = await connect(ALICE)
    bob: Conn = await connect("bob")
    typed: list[bytes] = []

    async def on_input(msg: Msg) -> None:
        typed.append(msg.data)

    await agent.nc.subscribe(subjects.session("node-a", "*", "*", "in"), cb=on_input)
    await round_trip(agent.nc)
    alices = subjects.session("node-a", "user-alice", "s1", "out")
    seen = await alice.nc.subscribe(alices)
    await round_trip(alice.nc)
    await agent.nc.publish(alices, b"alice's output")
    assert (await seen.next_msg(timeout=WAIT_SECONDS)).data == b"alice's output"

    for wildcard in (subjects.session("*", "*", "*", "out"), alices):
        await bob.nc.subscribe(wildcard)
        assert await bob.refused("subscription", wildcard)
    await bob.nc.publish(subjects.session("node-a", "user-alice", "s1", "in"), b"rm -rf /\n")
    assert await bob.refused("publish", subjects.session("node-a", "user-alice", "s1", "in"))
    await alice.nc.publish(subjects.session("node-a", "user-alice", "s1", "in"), b"ls\n")
    await asyncio.sleep(0.2)
    assert typed == [b"ls\n"]


async def test_services_read_their_streams_as_their_code_does(connect: ConnectAs) -> None:
    await declare_owned_streams(connect)
    agent: Conn = await connect(agent_user("node-b"))
    await agent.nc.jetstream().publish(subjects.node_logs("job-000000000003", 0, "node-b"), b"line",
                                       timeout=WAIT_SECONDS)
    # The monitor's durable pull consumer on the logs, fetched and acknowledged.
    monitor: Conn = await connect("monitor")
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    sub = await monitor.nc.jetstream().pull_subscribe(subjects.LOGS_ALL, durable=MONITOR_LOGS_CONSUMER,
                                                      stream=subjects.LOGS_STREAM, config=config)
    batch = await sub.fetch(1, timeout=WAIT_SECONDS)  # the one line there: at once
    assert batch
    await batch[-1].ack_sync(timeout=WAIT_SECONDS)
    # The scheduler's log pages: a direct message lookup in the stream.
    scheduler: Conn = await connect("scheduler")
    found = await scheduler.nc.jetstream().get_msg(subjects.LOGS_STREAM, seq=1,
                                                    subject=subjects.job_logs("job-000000000003"), next=True)
    assert found.data == b"line"
    assert not monitor.errors and not scheduler.errors and not agent.errors


def forged_tokens(secret: str) -> dict[str, str]:
    """Tokens NATS must not let in: signed with another secret, expired, unsigned (`alg: none`)."""
    import jwt

    identity = Identity(user=ALICE, projects=["default"], admin=True)
    unsigned = jwt.encode({"iss": "trainyard", "sub": ALICE, "admin": True, "iat": 0, "exp": 2**40}, key="",
                          algorithm="none")
    return {"another secret": issue_token(new_secret(), identity),
            "expired": issue_token(secret, identity, ttl_seconds=-10),
            "alg none": unsigned}


async def test_forged_expired_and_unsigned_tokens_are_refused(server: Server, callout: None) -> None:
    for kind, token in forged_tokens(server.secret).items():
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=WAIT_SECONDS, token=token)
        assert kind  # named for the failure message


async def test_no_one_reads_another_persons_replies(connect: ConnectAs) -> None:
    alice: Conn = await connect(ALICE)
    bob: Conn = await connect("bob")
    scheduler: Conn = await connect("scheduler")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"bob's jobs")

    await scheduler.nc.subscribe(LIST_JOBS.subject, queue="trainyard-scheduler", cb=answer)
    await round_trip(scheduler.nc)
    overheard: list[Msg] = []

    async def overhear(msg: Msg) -> None:
        overheard.append(msg)

    for subject in (f"{inbox_prefix('user-bob')}.>", "_INBOX.>"):
        await alice.nc.subscribe(subject, cb=overhear)
        assert await alice.refused("subscription", subject)
    assert (await bob.nc.request(LIST_JOBS.subject, b"{}", timeout=WAIT_SECONDS)).data == b"bob's jobs"
    await asyncio.sleep(0.2)
    assert overheard == []


async def test_a_node_credential_speaks_for_its_own_node_only(connect: ConnectAs) -> None:
    agent: Conn = await connect(agent_user("node-a"))
    await agent.nc.publish(subjects.heartbeat("node-a"), b"{}")
    await agent.nc.publish(subjects.heartbeat("node-b"), b"{}")
    assert await agent.refused("publish", subjects.heartbeat("node-b"))
    # The server answers a connection's messages in order: a refusal of node-a's would have come before node-b's.
    assert not await agent.refused("publish", subjects.heartbeat("node-a"), wait=0)
    forged = subjects.event_subject("launcher", "launch", "LaunchSucceeded")
    await agent.nc.publish(forged, b"{}")
    assert await agent.refused("publish", forged)


async def test_an_agent_cannot_shrink_the_event_stream(connect: ConnectAs) -> None:
    await declare_owned_streams(connect)
    agent: Conn = await connect(agent_user("node-a"))
    events = next(c for c in STREAMS if c.name == subjects.EVENTS_STREAM)
    with pytest.raises(Exception):  # noqa: B017
        await agent.nc.jetstream(timeout=1).update_stream(StreamConfig(name=events.name, subjects=events.subjects,
                                                                       max_msgs=1))
    assert await agent.refused("publish", f"$JS.API.STREAM.UPDATE.{subjects.EVENTS_STREAM}")


async def test_a_job_token_asks_only_its_own_nodes_and_reads_only_its_own_inbox(server: Server,
                                                                                  connect: ConnectAs) -> None:
    job = "job-0000000000aa"
    token = issue_job_token(server.secret, job, 1, ["node-a"])
    conn = await server.connect(NatsLogin.for_job(job, token))
    agent: Conn = await connect(agent_user("node-a"))

    async def answer(msg: Msg) -> None:
        await msg.respond(b"accepted")

    await agent.nc.subscribe(subjects.agent_exec("node-a"), cb=answer)
    await round_trip(agent.nc)
    assert (await conn.nc.request(subjects.agent_exec("node-a"), b"{}", timeout=WAIT_SECONDS)).data == b"accepted"
    # The agent may answer the exit into this job's inbox, not anyone else's.
    await agent.nc.publish(f"{job_inbox(job)}.exit", b"0")
    await agent.nc.publish(f"{inbox_prefix('user-alice')}.x", b"0")
    assert await agent.refused("publish", f"{inbox_prefix('user-alice')}.x")
    for subject in (subjects.agent_exec("node-b"), subjects.agent_start("node-a"), SUBMIT_JOB.subject):
        await conn.nc.publish(subject, b"{}")
        assert await conn.refused("publish", subject)
    other = f"{job_inbox('job-0000000000bb')}.>"
    await conn.nc.subscribe(other)
    assert await conn.refused("subscription", other)
    await conn.nc.close()
