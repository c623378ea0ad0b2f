"""A client stays connected through a restart of its NATS server, however long the server is away: the Python
client and the gateway's connection of one user, opened before the server went away for longer than they used to
try reconnecting (three attempts, about two seconds), answer once it is back. A request out when the server went
is sent again as soon as the connection is made anew when a second delivery can do nothing more; any other waits
for its own reply. A token that ran out meanwhile ends the connection instead. A first connection to a server that
is not there still fails at once, with a clear error.

Against nats-servers of the tests' own, killed with SIGKILL and started again on the same port and store; the
machine's own server is never restarted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from typer.testing import CliRunner

from client import cli
from client.api import TrainyardClient
from client.cli.runner import STACK_HINT
from devstack.natslogins import provision_nats_logins
from devstack.servers import free_port
from libs.auth import issue_token
from libs.contracts.codec import encode
from libs.contracts.identity import Identity
from libs.contracts.operations.base import Done
from libs.contracts.operations.jobs import DELETE_JOBS, LIST_JOBS, JobList, ListJobs
from libs.messaging.connection import ensure_streams, round_trip
from libs.messaging.rpc import ServiceUnavailable
from libs.natsauth import serve
from services.gateway.calls import Refused, UserCalls
from services.gateway.connections import UserConnections
from tests.support.own_nats import OwnNats
from tests.support.roles_server import RolesServer, logins_folder
from tests.support.schedulers import Schedulers, spec, token

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Longer than a client used to try reconnecting before it gave up for good (three attempts 0.5 s apart).
OUTAGE_SECONDS = 5.0
# A first connection to a server that is not there fails within this (about two seconds: four quick attempts).
FAIL_FAST_SECONDS = 10.0
BACK_SECONDS = 60.0  # for what happens once the server is back, on a machine that may be slow to get to it


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    server = OwnNats(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


@pytest_asyncio.fixture(loop_scope="session")
async def stand_in_nc(own_nats: OwnNats) -> AsyncIterator[Client]:
    """A service's connection to the test's server, reconnecting as the services' do."""
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield nc
    await nc.close()


async def until(condition: Any, what: str, seconds: float = BACK_SECONDS) -> None:
    """Wait until `condition()` holds."""
    try:
        async with asyncio.timeout(seconds):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {seconds:g}s") from None


async def answered(asking: Any) -> Any:
    """What the gateway answers once it is answered: `asking()` again while it is refused `unavailable` (the
    service reconnects at its own pace)."""
    async with asyncio.timeout(BACK_SECONDS):
        while True:
            try:
                return await asking()
            except Refused as exc:
                if exc.error.code != "unavailable":
                    raise
            await asyncio.sleep(0.2)


# --- clients opened before a restart answer after it -------------------------------------------------------


async def test_a_client_and_a_gateway_connection_answer_after_their_nats_server_was_away(
        own_nats: OwnNats, database_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(own_nats.url)
    await ensure_streams(nc.jetstream())  # as the streams' owners would
    await nc.close()
    schedulers = Schedulers(own_nats.url, database_url, tmp_path / "storage")
    await schedulers.start()
    alice = token("alice")
    client = await TrainyardClient.open(own_nats.url, token=alice)
    connections = UserConnections(own_nats.url)
    calls = UserCalls(connections)
    try:
        accepted = await client.submit(spec("before-the-restart"))
        gateway_nc = await connections.for_token(alice)

        async def gateway_list() -> JobList:
            listed: JobList = await calls.ask(LIST_JOBS, ListJobs(), alice)
            return listed

        assert accepted.job_id in {job.job_id for job in (await gateway_list()).jobs}

        own_nats.kill()
        meanwhile = asyncio.ensure_future(client.get_job(accepted.job_id))  # asked while the server is away
        await asyncio.sleep(OUTAGE_SECONDS)
        assert not client.closed, "the client gave up reconnecting"
        assert not gateway_nc.is_closed, "the gateway's connection gave up reconnecting"
        own_nats.start()

        assert (await asyncio.wait_for(meanwhile, BACK_SECONDS)).job.job_id == accepted.job_id
        assert accepted.job_id in {job.job_id for job in await client.list_jobs()}
        assert (await client.get_job(accepted.job_id)).job.status == "queued"
        assert accepted.job_id in {job.job_id for job in (await answered(gateway_list)).jobs}
        assert await connections.for_token(alice) is gateway_nc  # the same connection, made anew underneath
        assert client.reconnections is not None and client.reconnections.last is not None
    finally:
        await client.close()
        await connections.close()
        await schedulers.stop_all()


async def test_a_gateway_connection_held_by_a_stream_hears_its_subscription_after_a_restart(
        own_nats: OwnNats, stand_in_nc: Client) -> None:
    """A follow stream or a terminal holds its user's connection and listens on it: its subscription is made
    again on the connection made anew."""
    connections = UserConnections(own_nats.url)
    subject = "trainyard.test.held"
    try:
        async with connections.held(token("alice")) as nc:
            heard = await nc.subscribe(subject)
            await round_trip(nc)
            own_nats.kill()
            await asyncio.sleep(OUTAGE_SECONDS)
            assert not nc.is_closed
            own_nats.start()
            await until(lambda: nc.is_connected and stand_in_nc.is_connected, "reconnecting")
            await round_trip(nc)
            await stand_in_nc.publish(subject, b"after the restart")
            msg = await heard.next_msg(timeout=BACK_SECONDS)
            assert msg.data == b"after the restart"
    finally:
        await connections.close()


# --- requests out when the server goes -----------------------------------------------------------------------


class StandIn:
    """A service that records every request on its subject; it leaves the first `silent` unanswered (held in
    `held`, their replies lost for now) and answers the later ones with `reply`."""

    def __init__(self, reply: Any, silent: int = 1) -> None:
        self.reply, self.silent = reply, silent
        self.received: list[bytes] = []
        self.held: list[Msg] = []

    async def handle(self, msg: Msg) -> None:
        self.received.append(msg.data)
        if len(self.received) <= self.silent:
            self.held.append(msg)
            return
        await msg.respond(encode(self.reply))


async def serving(nc: Client, subject: str, stand_in: StandIn) -> None:
    await nc.subscribe(subject, cb=stand_in.handle)
    await round_trip(nc)


async def out_when_the_server_restarts(own_nats: OwnNats, stand_in: StandIn, asking: Awaitable[Any]) -> asyncio.Task[
        Any]:
    """`asking` sent, and the server killed and started again as soon as the stand-in has the request."""
    task = asyncio.ensure_future(asking)
    await until(lambda: stand_in.received or task.done(), "the request reaching the service")
    own_nats.kill()
    own_nats.start()
    return task


async def test_a_query_out_when_the_server_restarts_is_sent_again_at_once(own_nats: OwnNats,
                                                                         stand_in_nc: Client) -> None:
    stand_in = StandIn(JobList(jobs=[]))
    await serving(stand_in_nc, LIST_JOBS.subject, stand_in)
    client = await TrainyardClient.open(own_nats.url, token=token("alice"))
    # An attempt's timeout far beyond the test's patience: an answer came from the request sent again on the new
    # connection, not from one sent after the first one's timeout.
    client.timeout = 3600.0
    try:
        listing = await out_when_the_server_restarts(own_nats, stand_in, client.list_jobs())
        assert await asyncio.wait_for(listing, BACK_SECONDS) == []
        assert len(stand_in.received) == 2
        assert stand_in.received[0] == stand_in.received[1]
    finally:
        await client.close()


async def test_a_deletion_out_when_the_server_restarts_is_sent_once_and_takes_its_own_reply(
        own_nats: OwnNats, stand_in_nc: Client) -> None:
    """A deletion sent twice would be refused the second time (the first deleted the job): it is sent once, and
    its reply, sent once the service and the client are connected anew, is taken."""
    stand_in = StandIn(Done(job_ids=[]), silent=1)
    await serving(stand_in_nc, DELETE_JOBS.subject, stand_in)
    client = await TrainyardClient.open(own_nats.url, token=token("alice"))
    client.timeout = 3600.0
    try:
        deleting = await out_when_the_server_restarts(own_nats, stand_in, client.delete(["job-0000000000d1"]))
        reconnections = client.reconnections
        assert reconnections is not None
        await until(lambda: reconnections.last is not None and stand_in_nc.is_connected, "reconnecting")
        await asyncio.sleep(1.0)  # time for a request sent again to arrive, were it sent again
        assert not deleting.done()
        [request] = stand_in.held
        await request.respond(encode(Done(job_ids=["job-0000000000d1"], message="deleted 1 job(s)")))
        done = await asyncio.wait_for(deleting, BACK_SECONDS)
        assert done.message == "deleted 1 job(s)"
        assert len(stand_in.received) == 1
    finally:
        await client.close()


# --- closing, and tokens that run out ------------------------------------------------------------------------


async def test_connections_closed_while_the_server_is_away_stay_closed(own_nats: OwnNats) -> None:
    """nats-py cannot drain a connection that is reconnecting: closing one then closes it at once, rather than
    leaving it to reconnect for ever."""
    client = await TrainyardClient.open(own_nats.url, token=token("alice"))
    connections = UserConnections(own_nats.url, idle_seconds=0)
    gateway_nc = await connections.for_token(token("bob"))
    own_nats.kill()
    await until(lambda: not client.nc.is_connected and not gateway_nc.is_connected, "noticing the server gone")

    await client.close()
    await connections.close_idle()

    assert client.closed and gateway_nc.is_closed
    assert len(connections) == 0


async def test_a_token_that_ran_out_while_the_server_was_away_ends_the_connection(tmp_path: Path) -> None:
    """On the stack's own NATS configuration (logins through the auth callout): the server is back before the
    service answering its callout, so the first reconnections are refused; a valid token's connection is admitted
    once the callout is answered, while one whose token ran out meanwhile is closed, as NATS closes a connected one."""
    home = tmp_path / "home"
    server = OwnNats(tmp_path / "nats", provision_nats_logins(home))
    server.start()
    roles = RolesServer(server.url, logins_folder(home), "reconnect-tests-signing-secret-0123456789abcdef")
    callout = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                 **roles.login("scheduler").options())
    await serve(callout, seed=roles.issuer_seed(), secret=roles.secret, service="scheduler")
    await round_trip(callout)
    lasting = await TrainyardClient.open(server.url, token=issue_token(roles.secret, Identity(user="alice")))
    expiring = await TrainyardClient.open(server.url, token=issue_token(roles.secret, Identity(user="bob"),
                                                                           ttl_seconds=3))
    try:
        server.kill()
        await asyncio.sleep(OUTAGE_SECONDS)
        await callout.close()  # the callout's service comes back after the server
        server.start()
        await asyncio.sleep(3.0)  # the server refuses logins meanwhile: nothing answers its callout
        assert not lasting.closed
        callout = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                     **roles.login("scheduler").options())
        await serve(callout, seed=roles.issuer_seed(), secret=roles.secret, service="scheduler")
        await round_trip(callout)

        await until(lambda: lasting.nc.is_connected, "the lasting token's connection being admitted again")
        await until(lambda: expiring.closed, "the connection of the token that ran out being closed")
        assert not lasting.closed
    finally:
        await lasting.close()
        await expiring.close()
        await callout.close()
        server.kill()


# --- a first connection still fails fast -----------------------------------------------------------------------


async def test_a_first_connection_to_a_server_that_is_not_there_fails_at_once() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(ServiceUnavailable, match=rf"^cannot connect to NATS at {url} \("):
        await TrainyardClient.open(url, token=token("alice"))
    assert time.monotonic() - began < FAIL_FAST_SECONDS

    calls = UserCalls(UserConnections(url))
    began = time.monotonic()
    with pytest.raises(Refused) as refused:
        await calls.ask(LIST_JOBS, ListJobs(), token("alice"))
    assert time.monotonic() - began < FAIL_FAST_SECONDS
    assert refused.value.error.code == "unavailable"
    assert refused.value.error.message == "the gateway cannot reach NATS right now"
    assert len(calls.connections) == 0


async def test_the_cli_says_at_once_that_nats_cannot_be_reached(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    env = {"NATS_URL": url, "TRAINYARD_TOKEN": token("alice"), "TRAINYARD_HOME": str(tmp_path / "home")}
    began = time.monotonic()
    result = await asyncio.to_thread(CliRunner().invoke, cli.app, ["list"], env=env)
    assert time.monotonic() - began < FAIL_FAST_SECONDS
    assert result.exit_code == 1
    assert f"cannot connect to NATS at {url}" in result.output
    assert STACK_HINT in result.output

