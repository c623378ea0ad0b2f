"""A request cannot lend its responder's rights to the reply subject it names.

On a real nats-server with the shipped roles (libs/natsroles.py, logins through the auth callout), a
person asks a scheduler responder (libs/messaging/rpc.py, logged in as the scheduler) and a job asks
a node agent's responder (agent/requests.py, logged in as the agent), each naming as its reply
subject what it may not publish to itself: another service's event stream, another job's usage entry
in the key-value bucket, the agent-report stream, another person's inbox, the JetStream API. Each
such request is refused: nothing arrives there, nothing is carried out, and the refusal is counted
in `trainyard.requests.reply_refused`. The same requests with their own inbox are answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
import pytest_asyncio
from faststream.nats import NatsBroker, NatsUserPassword
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig
from nats.js.errors import NotFoundError

from agent.requests import RequestServer
from libs.auth import bearer_headers, issue_job_token, issue_token, new_secret
from libs.contracts import subjects
from libs.contracts.agent import ExecInJob, ProcessAccepted
from libs.contracts.codec import decode_any, encode
from libs.contracts.identity import Identity
from libs.contracts.operations.agents import EXEC_IN_JOB
from libs.contracts.operations.base import Done
from libs.contracts.operations.catalogue import PEOPLE_REPLIES as Reply
from libs.contracts.operations.jobs import STOP_JOBS, StopJobs
from libs.contracts.operations.planning import SimulationProgress
from libs.messaging.connection import STREAMS, NatsLogin, round_trip
from libs.messaging.responder import progress_reporter, subject_template
from libs.messaging.rpc import call_with_progress, serve_operations
from libs.natsauth import serve
from libs.natsroles import STREAM_OWNERS, agent_user, inbox_prefix, job_inbox
from tests.support.refusals import Refusals, count_refusals
from tests.support.roles_server import Conn, RolesServer, serving_roles

JOB = "job-0000000000aa"  # the job whose remote shell asks the agent
OTHER_JOB = "job-0000000000bb"  # whose usage entry a hostile reply would overwrite
WAIT_SECONDS = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolesServer]:
    home = tmp_path_factory.mktemp("nats-replies")
    with serving_roles(home) as served:
        yield served


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> Refusals:
    return count_refusals(monkeypatch)


class Cluster:
    """The roles of one test: connections it opened, and what the responders carried out."""

    def __init__(self, server: RolesServer) -> None:
        self.server = server
        self.opened: list[Client] = []
        self.stopped: list[list[str]] = []  # the job ids of each StopJobs the scheduler carried out
        self.execs: list[str] = []  # the commands the agent ran

    async def connect(self, login: NatsLogin | str) -> Conn:
        conn = await self.server.connect(self.server.login(login) if isinstance(login, str) else login)
        self.opened.append(conn.nc)
        return conn

    def token(self, user: str) -> str:
        return issue_token(self.server.secret, Identity(user=user, projects=["default"], admin=False))

    async def declare_streams(self) -> None:
        """What each owner's `ensure_streams` declares: the scheduler the events and the usage bucket, the
        launcher the agent reports, the monitor the logs."""
        for config in STREAMS:
            assert config.name is not None
            owner = await self.connect(STREAM_OWNERS[config.name])
            await owner.nc.jetstream().add_stream(config)
        scheduler = await self.connect("scheduler")
        await scheduler.nc.jetstream().create_key_value(KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1))


@pytest_asyncio.fixture
async def cluster(server: RolesServer) -> AsyncIterator[Cluster]:
    """The auth callout answered as the scheduler answers it, the streams declared, and a scheduler responder
    for `StopJobs` (a command: what it carries out is recorded) logged in as the scheduler."""
    found = Cluster(server)
    callout = await nats.connect(server.url, **server.login("scheduler").options())
    await serve(callout, seed=server.issuer_seed(), secret=server.secret, service="scheduler")
    await round_trip(callout)
    await found.declare_streams()
    broker = NatsBroker(server.url, logger=None, apply_types=False, inbox_prefix=inbox_prefix("scheduler"),
                        security=NatsUserPassword("scheduler", server.password("scheduler")))

    async def stop(request: StopJobs, _: Identity) -> Done:
        found.stopped.append(request.job_ids)
        reporter = progress_reporter()  # progress goes to the reply subject too, before the reply
        if reporter is not None:
            await reporter(SimulationProgress(stage="playing", played=0.5))
        return Done(job_ids=request.job_ids)

    serve_operations(broker, "scheduler", [(STOP_JOBS, stop)], secret=server.secret)
    await broker.start()
    yield found
    await broker.stop()
    for nc in found.opened:
        await nc.close()
    await callout.close()


async def nothing_stored(conn: Conn, stream: str, subject: str) -> bool:
    try:
        await conn.nc.jetstream().get_msg(stream, subject=subject)
    except NotFoundError:
        return True
    return False


# --- a person asks the scheduler ------------------------------------------------------------------------------

async def test_a_reply_into_another_services_event_stream_is_refused(cluster: Cluster, refusals: Refusals) -> None:
    forged = subjects.event_subject("launcher", "launch", "LaunchSucceeded")
    await hostile_request(cluster, refusals, forged)
    launcher = await cluster.connect("launcher")
    assert await nothing_stored(launcher, subjects.EVENTS_STREAM, forged)


async def test_a_reply_over_another_jobs_usage_entry_is_refused(cluster: Cluster, refusals: Refusals) -> None:
    agent = await cluster.connect(agent_user("node-a"))
    usage = await agent.nc.jetstream().key_value(subjects.USAGE_BUCKET)
    key = subjects.usage_key(OTHER_JOB, 1, 0, "node-a")
    await usage.put(key, b'{"gpu": 0.5}')
    await hostile_request(cluster, refusals, f"$KV.{subjects.USAGE_BUCKET}.{key}")
    scheduler = await cluster.connect("scheduler")
    entry = await scheduler.nc.jetstream().get_msg(subjects.USAGE_STREAM, subject=f"$KV.{subjects.USAGE_BUCKET}.{key}")
    assert entry.data == b'{"gpu": 0.5}'


async def test_a_reply_into_the_agent_report_stream_is_refused(cluster: Cluster, refusals: Refusals) -> None:
    await hostile_request(cluster, refusals, subjects.agent_report("node-a"))
    launcher = await cluster.connect("launcher")
    assert await nothing_stored(launcher, subjects.AGENT_REPORTS_STREAM, subjects.agent_report("node-a"))


async def test_a_reply_into_another_persons_inbox_is_refused(cluster: Cluster, refusals: Refusals) -> None:
    bob = await cluster.connect("bob")
    arrived: list[Msg] = []

    async def on_reply(msg: Msg) -> None:
        arrived.append(msg)

    await bob.nc.subscribe(f"{inbox_prefix('user-bob')}.>", cb=on_reply)
    await round_trip(bob.nc)
    await hostile_request(cluster, refusals, f"{inbox_prefix('user-bob')}.lure")
    await round_trip(bob.nc)
    assert arrived == []


async def test_a_reply_onto_the_jetstream_api_is_refused_and_purges_nothing(cluster: Cluster,
                                                                            refusals: Refusals) -> None:
    agent = await cluster.connect(agent_user("node-b"))
    await agent.nc.jetstream().publish(subjects.agent_report("node-b"), b"{}", timeout=WAIT_SECONDS)
    launcher = await cluster.connect("launcher")
    before = (await launcher.nc.jetstream().stream_info(subjects.AGENT_REPORTS_STREAM)).state.messages
    await hostile_request(cluster, refusals, f"$JS.API.STREAM.PURGE.{subjects.AGENT_REPORTS_STREAM}")
    after = (await launcher.nc.jetstream().stream_info(subjects.AGENT_REPORTS_STREAM)).state.messages
    assert after == before >= 1


async def hostile_request(cluster: Cluster, refusals: Refusals, reply: str) -> None:
    """Alice asks with `reply` as the reply subject: refused and counted, nothing carried out; then the same
    request in her own inbox is answered (its progress too) and carried out."""
    alice = await cluster.connect("alice")
    token = cluster.token("alice")
    before = refusals.count(STOP_JOBS.subject)
    await alice.nc.publish(STOP_JOBS.subject, encode(StopJobs(job_ids=[OTHER_JOB])), reply=reply,
                           headers=bearer_headers(token))
    await refusals.counted(STOP_JOBS.subject, before + 1)
    assert cluster.stopped == []
    assert alice.errors == []  # the server let her send it: only the responder can refuse it

    progress: list[Any] = []
    answered = await call_with_progress(alice.nc, STOP_JOBS.subject, StopJobs(job_ids=[JOB]), token=token,
                                        idle_timeout=WAIT_SECONDS, progress_type=SimulationProgress,
                                        on_progress=progress.append)
    assert answered == Done(job_ids=[JOB])
    assert progress == [SimulationProgress(stage="playing", played=0.5)]
    # nats-py's request, through the one subscription it answers all requests on: under her prefix too.
    first = await alice.nc.request(STOP_JOBS.subject, encode(StopJobs(job_ids=[JOB])), timeout=WAIT_SECONDS,
                                   headers=bearer_headers(token))
    assert first.subject.startswith(inbox_prefix("user-alice") + ".")
    assert decode_any(first.data, Reply) == SimulationProgress(stage="playing", played=0.5)
    assert cluster.stopped == [[JOB], [JOB]]
    assert refusals.count(STOP_JOBS.subject) == before + 1


async def test_a_request_with_a_forged_token_is_not_answered_in_another_persons_inbox(
        cluster: Cluster, refusals: Refusals) -> None:
    """Its `unauthenticated` would go only to the inbox of whom the token names, here not even that."""
    alice = await cluster.connect("alice")
    forged = issue_token(new_secret(), Identity(user="alice", projects=["default"], admin=True))
    await alice.nc.publish(STOP_JOBS.subject, encode(StopJobs(job_ids=[JOB])),
                           reply=f"{inbox_prefix('user-bob')}.lure", headers=bearer_headers(forged))
    await refusals.counted(STOP_JOBS.subject, 1)
    assert cluster.stopped == []


# --- a job asks a node agent ----------------------------------------------------------------------------------

@pytest_asyncio.fixture
async def agent_responder(cluster: Cluster) -> AsyncIterator[None]:
    """Node node-a's agent answering execs (`agent.requests.RequestServer`, logged in with its node credential);
    the job's token is taken as given: what is tested here is where the answer goes."""
    agent = await cluster.connect(agent_user("node-a"))

    async def run(request: ExecInJob) -> ProcessAccepted:
        cluster.execs.append(request.command)
        return ProcessAccepted(already_known=False)

    await RequestServer(agent.nc, "node-a").serve(EXEC_IN_JOB, run, lambda _, __: None)
    await round_trip(agent.nc)
    yield


AGENT_LURES = {
    "the agent-report stream": subjects.agent_report("node-a"),
    "the JetStream API": f"$JS.API.STREAM.PURGE.{subjects.AGENT_REPORTS_STREAM}",
    "another job's inbox": f"{job_inbox(OTHER_JOB)}.exit",
    "a person's inbox": f"{inbox_prefix('user-alice')}.lure",
}


@pytest.mark.parametrize("lure", AGENT_LURES.values(), ids=AGENT_LURES.keys())
async def test_an_agent_answers_a_jobs_exec_only_in_the_jobs_inbox(cluster: Cluster, refusals: Refusals,
                                                                   agent_responder: None, lure: str) -> None:
    token = issue_job_token(cluster.server.secret, JOB, 1, ["node-a"])
    job = await cluster.connect(NatsLogin.for_job(JOB, token))
    template = subject_template(subjects.agent_exec("node-a"), "node-a")
    request = ExecInJob(job_id=JOB, attempt=1, command="hostname", reply_to=f"{job_inbox(JOB)}.exit")

    await job.nc.publish(subjects.agent_exec("node-a"), encode(request), reply=lure, headers=bearer_headers(token))
    await refusals.counted(template, 1)
    assert cluster.execs == []
    launcher = await cluster.connect("launcher")
    assert await nothing_stored(launcher, subjects.AGENT_REPORTS_STREAM, subjects.agent_report("node-a"))

    answered = await job.nc.request(subjects.agent_exec("node-a"), encode(request), timeout=WAIT_SECONDS,
                                    headers=bearer_headers(token))
    assert answered.subject.startswith(job_inbox(JOB) + ".")
    assert cluster.execs == ["hostname"]
    assert refusals.count(template) == 1
