"""The follow streams: a job's log and status as Server-Sent Events over real HTTP (uvicorn on a free port), from a
real scheduler on real NATS and PostgreSQL, acting as the caller; refusals known before a stream starts as problem
details, and a follower that left stops asking. Without a monitor the streams poll; with one (`watched`), the job's
log chunks and changes are pushed, and the services are read only when something happened or a push is missing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
import uvicorn
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.agent import LogChunk
from libs.contracts.codec import encode
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.operations.base import Operation
from services.gateway import follow
from services.gateway.app import build_app
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.follow import FollowStreams
from services.gateway.service import EmbeddedServer
from services.gateway.sessions import SESSION_COOKIE, Sessions
from services.monitor.service import Monitor
from tests.support.monitor import start_monitor
from tests.support.schedulers import Schedulers, spec, token
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROBLEM = "application/problem+json"
POLL_SECONDS = 0.05


class CountingCalls(UserCalls):
    """Asks as `UserCalls` does, and counts what it asked."""

    asked = 0

    def __init__(self, connections: UserConnections) -> None:
        super().__init__(connections)
        self.by_operation: Counter[str] = Counter()

    async def ask(self, operation: Operation[Any, Any], request: msgspec.Struct, token: str) -> Any:
        self.asked += 1
        self.by_operation[operation.name] += 1
        return await super().ask(operation, request, token)


@dataclass
class Gateway:
    http: httpx.AsyncClient
    streams: FollowStreams
    calls: CountingCalls
    sessions: Sessions


@dataclass(frozen=True)
class Event:
    kind: str  # `comment` for a comment line
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str, schedulers: Schedulers, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    """The gateway with its follow streams, served by uvicorn in the test's process, a scheduler behind it."""
    for constant in ("LOGS_POLL_SECONDS", "METRICS_POLL_SECONDS", "STATUS_POLL_SECONDS", "ALERTS_POLL_SECONDS"):
        monkeypatch.setattr(follow, constant, POLL_SECONDS)
    monkeypatch.setattr(follow, "LOG_DRAIN_SECONDS", 0.2)
    await schedulers.start()
    connections = UserConnections(nats_url)
    sessions = Sessions()
    app = build_app(connections, sessions)
    calls = CountingCalls(connections)
    streams = FollowStreams(calls, sessions)
    app.router.routes[0:0] = streams.routes()  # ahead of the app's own, so that these count what they ask
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = EmbeddedServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                           log_level="warning", timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    await eventually(lambda: _started(server, serving))
    base_url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        yield Gateway(http, streams, calls, sessions)
    server.should_exit = True
    await serving
    await connections.close()


async def _started(server: uvicorn.Server, serving: asyncio.Task[None]) -> bool:
    if serving.done():
        serving.result()  # what kept it from serving
    return server.started


def as_user(user: str, *projects: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(user, *projects)}"}


async def submitted(http: httpx.AsyncClient, user: str = "alice") -> str:
    job_id = new_job_id()
    accepted = await http.post("/api/v1/submit-job", headers=as_user(user),
                               json={"job_id": job_id, "spec": msgspec.to_builtins(spec())})
    assert accepted.status_code == 200, accepted.text
    return job_id


async def stop(http: httpx.AsyncClient, job_id: str) -> None:
    stopped = await http.post("/api/v1/stop-jobs", json={"job_ids": [job_id]}, headers=as_user("alice"))
    assert stopped.status_code == 200, stopped.text


async def publish_chunk(nc: Client, job_id: str, rank: int, seq: int, lines: list[str], shipment: str = "") -> None:
    """A chunk of the job's log, stored as an agent stores it (as tests/integration/test_job_logs.py does);
    `shipment` tells one shipped again after the stream's duplicate window, which the stream stores again."""
    chunk = LogChunk(job_id=job_id, attempt=1, rank=rank, node=f"node-{rank}", seq=seq, lines=lines)
    await nc.jetstream().publish(subjects.node_logs(job_id, rank, chunk.node), encode(chunk),
                                 headers={"Nats-Msg-Id": f"{job_id}.1.0.{rank}.log.{seq}{shipment}"})


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """The events of a stream as an EventSource reads them, and its comments. A line ends at a line feed only:
    the stream must hold no carriage return, which an EventSource would also take for a line's end."""
    kind, event_id, pending = "message", None, b""
    data: list[str] = []
    async for received in response.aiter_bytes():
        assert b"\r" not in received
        *lines, pending = (pending + received).split(b"\n")
        for line in (raw.decode() for raw in lines):
            if not line:
                if data:
                    yield Event(kind, "\n".join(data), event_id)
                kind, data, event_id = "message", [], None
            elif line.startswith(":"):
                yield Event("comment", line[1:].strip())
            else:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    kind = value
                elif name == "data":
                    data.append(value)
                elif name == "id":
                    event_id = value


async def taken(stream: AsyncIterator[Event], count: int | None = None) -> list[Event]:
    """The next `count` events (comments passed over), or every event until the stream closes."""
    found: list[Event] = []
    async with asyncio.timeout(30):  # a stream that never sends what is awaited fails instead of hanging
        async for event in stream:
            if event.kind != "comment":
                found.append(event)
            if count is not None and len(found) == count:
                break
    return found


def lines_of(found: list[Event]) -> list[str]:
    return [line for event in found if event.kind == "log" for line in event.json()["lines"]]


async def test_a_followed_log_arrives_in_order_and_ends_after_the_job_ended(gateway: Gateway, nc: Client) -> None:
    job_id = await submitted(gateway.http)
    tricky = "carriage\rreturn and\nline feed\r\ndata: forged\u2028\x85 end"
    for seq, line in enumerate(["first", tricky, "third"]):
        await publish_chunk(nc, job_id, seq % 2, seq, [line])

    async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = events(response)
        stored = await taken(stream, 3)
        assert lines_of(stored) == ["first", tricky, "third"]
        assert [event.json()["rank"] for event in stored] == [0, 1, 0]
        assert all(event.id for event in stored)

        await publish_chunk(nc, job_id, 0, 3, ["written while followed"])
        assert lines_of(await taken(stream, 1)) == ["written while followed"]

        await stop(gateway.http, job_id)
        rest = await taken(stream)  # until the stream closes
    assert [event.kind for event in rest] == ["end"]


async def test_resuming_with_the_last_event_id_gives_only_the_later_chunks(gateway: Gateway, nc: Client) -> None:
    job_id = await submitted(gateway.http)
    for seq in range(4):
        await publish_chunk(nc, job_id, 0, seq, [f"line {seq}"])
    await stop(gateway.http, job_id)

    async def followed(last_event_id: str | None = None) -> list[Event]:
        headers = as_user("alice") | ({"Last-Event-ID": last_event_id} if last_event_id else {})
        async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                       headers=headers) as response:
            assert response.status_code == 200
            return await taken(events(response))

    everything = await followed()
    assert lines_of(everything) == [f"line {seq}" for seq in range(4)] and everything[-1].kind == "end"
    # The first chunk's id stands inside its page; the last one's where the next page starts.
    assert lines_of(await followed(everything[0].id)) == ["line 1", "line 2", "line 3"]
    assert lines_of(await followed(everything[2].id)) == ["line 3"]
    assert [event.kind for event in await followed(everything[3].id)] == ["end"]

    refused = await gateway.http.get("/api/v1/follow/logs", params={"job_id": job_id},
                                     headers=as_user("alice") | {"Last-Event-ID": "yesterday"})
    assert refused.status_code == 400 and refused.json()["errors"][0]["field"] == "Last-Event-ID"


async def test_another_users_job_is_not_found_before_any_stream(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)
    for path in ("/api/v1/follow/logs", "/api/v1/follow/status"):
        refused = await gateway.http.get(path, params={"job_id": job_id}, headers=as_user("bob", "other"))
        assert refused.status_code == 404
        assert refused.headers["content-type"] == PROBLEM
        assert refused.json()["code"] == "not-found" and refused.json()["instance"] == path

    anonymous = await gateway.http.get("/api/v1/follow/status", params={"job_id": job_id})
    assert anonymous.status_code == 401 and anonymous.headers["content-type"] == PROBLEM


async def test_a_missing_or_wrong_parameter_is_named(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)
    cases = [({}, "job_id"), ({"job_id": job_id, "rank": "1e3"}, "rank"), ({"job_id": job_id, "rank": "-1"}, "rank"),
             ({"job_id": job_id, "after": "5"}, "after"), ({"job_id": job_id, "colour": "red"}, "colour")]
    for params, field in cases:
        refused = await gateway.http.get("/api/v1/follow/logs", params=params, headers=as_user("alice"))
        assert refused.status_code == 400, params
        assert refused.headers["content-type"] == PROBLEM
        assert refused.json()["errors"][0]["field"] == field, params
    twice = await gateway.http.get(f"/api/v1/follow/status?job_id={job_id}&job_id={job_id}", headers=as_user("alice"))
    assert twice.status_code == 400 and twice.json()["errors"][0]["field"] == "job_id"
    unnamed = await gateway.http.get("/api/v1/follow/metrics", params={"job_id": job_id}, headers=as_user("alice"))
    assert unnamed.status_code == 400 and unnamed.json()["detail"] == "name: is required"


async def test_the_status_stream_shows_each_change_until_the_job_ended(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)
    async with gateway.http.stream("GET", "/api/v1/follow/status", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        stream = events(response)
        [queued] = await taken(stream, 1)
        assert (queued.kind, queued.json()["job_id"], queued.json()["status"]) == ("status", job_id, "queued")
        await stop(gateway.http, job_id)
        rest = await taken(stream)
    assert [(event.kind, event.json().get("status")) for event in rest] == [("status", "stopped"), ("end", None)]


async def test_a_console_session_follows_with_its_cookie(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)
    session_id, _ = gateway.sessions.open(token("alice"), Identity(user="alice", projects=["default"]))
    async with gateway.http.stream("GET", "/api/v1/follow/status", params={"job_id": job_id},
                                   cookies={SESSION_COOKIE: session_id}) as response:
        assert response.status_code == 200
        [status] = await taken(events(response), 1)
    assert status.json()["status"] == "queued"


async def test_a_refusal_while_streaming_is_an_error_event(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow, "LOG_DRAIN_SECONDS", 300.0)  # the stream outlives the job's deletion
    job_id = await submitted(gateway.http)
    await stop(gateway.http, job_id)
    async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        assert response.status_code == 200
        deleted = await gateway.http.post("/api/v1/delete-jobs", json={"job_ids": [job_id]}, headers=as_user("alice"))
        assert deleted.status_code == 200, deleted.text
        found = await taken(events(response))
    assert [event.kind for event in found] == ["error"]
    assert found[0].json()["code"] == "not-found" and found[0].json()["status"] == 404


async def test_an_idle_stream_sends_keep_alive_comments(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow, "KEEP_ALIVE_SECONDS", 0.05)
    job_id = await submitted(gateway.http)
    async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        async with asyncio.timeout(30):
            first = await anext(events(response))
    assert first == Event("comment", "keep-alive")


async def test_a_stream_whose_service_does_not_answer_is_refused_before_it_starts(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)  # no monitor runs: it answers the series and the alerts
    for path, params in (("/api/v1/follow/metrics", {"job_id": job_id, "name": "loss"}), ("/api/v1/follow/alerts", {})):
        refused = await gateway.http.get(path, params=params, headers=as_user("alice"))
        assert refused.status_code == 503 and refused.headers["content-type"] == PROBLEM, path
        assert "monitor" in refused.json()["hint"]


async def test_a_token_holds_at_most_twenty_streams(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)
    held = token("alice")  # a token's time is in it: the same one throughout

    async def opened(stack: contextlib.AsyncExitStack, bearer: str) -> httpx.Response:
        return await stack.enter_async_context(gateway.http.stream(
            "GET", "/api/v1/follow/status", params={"job_id": job_id}, headers={"Authorization": f"Bearer {bearer}"}))

    async with contextlib.AsyncExitStack() as stack:
        for _ in range(follow.MOST_STREAMS_PER_TOKEN):
            response = await opened(stack, held)
            assert response.status_code == 200
        over = await gateway.http.get("/api/v1/follow/status", params={"job_id": job_id},
                                      headers={"Authorization": f"Bearer {held}"})
        assert over.status_code == 429 and over.json()["code"] == "over-cap"

        async with contextlib.AsyncExitStack() as one_more:
            assert (await opened(one_more, token("alice", "default", "vision"))).status_code == 200  # another token
        await response.aclose()  # a tab closed
        await eventually(lambda: _below_cap(gateway, held))
        assert (await opened(stack, held)).status_code == 200


async def _below_cap(gateway: Gateway, held: str) -> bool:
    return gateway.streams.slots.open_with(held) < follow.MOST_STREAMS_PER_TOKEN


async def test_a_follower_that_left_stops_asking(gateway: Gateway) -> None:
    job_id = await submitted(gateway.http)  # queued for good: its status stream would poll forever
    alice = token("alice")
    async with gateway.http.stream("GET", "/api/v1/follow/status", params={"job_id": job_id},
                                   headers={"Authorization": f"Bearer {alice}"}) as response:
        stream = events(response)  # held: a reader dropped closes the connection
        await taken(stream, 1)
        polled = gateway.calls.asked
        await eventually(lambda: _more_than(gateway, polled))  # it polls while followed
    await eventually(lambda: _none_open(gateway, alice))
    left = gateway.calls.asked
    await asyncio.sleep(20 * POLL_SECONDS)
    assert gateway.calls.asked == left


async def _more_than(gateway: Gateway, asked: int) -> bool:
    return gateway.calls.asked > asked


async def _none_open(gateway: Gateway, alice: str) -> bool:
    return gateway.streams.slots.open_with(alice) == 0


# --- with a monitor: the streams of a job watch it ---------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def watched(gateway: Gateway, schedulers: Schedulers) -> AsyncIterator[Monitor]:
    """A monitor beside the gateway's scheduler: it takes the streams' watches and pushes what happens."""
    runtime, monitor = await start_monitor(schedulers.settings)
    try:
        yield monitor
    finally:
        await runtime.close()


async def _watched(monitor: Monitor, job_id: str, count: int = 1) -> bool:
    return len(monitor.watching.watches.of(job_id)) == count


async def test_a_watched_log_is_pushed_and_read_only_when_a_push_is_missing(gateway: Gateway, watched: Monitor,
                                                                             nc: Client,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = await submitted(gateway.http)
    dropped: list[int] = []
    queue = watched.watching._queue

    def losing(inbox: str, data: bytes) -> None:  # the fifth chunk's push never reaches the gateway
        if b"LogPushed" in data and b'"seq":4,' in data and not dropped:
            dropped.append(len(data))
            return
        queue(inbox, data)

    monkeypatch.setattr(watched.watching, "_queue", losing)
    async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        stream = events(response)
        await eventually(lambda: _watched(watched, job_id))
        await publish_chunk(nc, job_id, 0, 0, ["line 0"])
        first = await taken(stream, 1)  # the watch's first push names no earlier chunk: read as a page
        read_before = gateway.calls.by_operation["job-logs"]
        for seq in range(1, 10):
            await publish_chunk(nc, job_id, seq % 2, seq, [f"line {seq}"])
            await asyncio.sleep(10 * POLL_SECONDS)  # a polling stream would read the log 10 times in between
        rest = await taken(stream, 9)
        read = gateway.calls.by_operation["job-logs"] - read_before
    found = first + rest
    assert dropped, "the fifth chunk was pushed"
    assert lines_of(found) == [f"line {seq}" for seq in range(10)]  # each once, in order
    cursors = [tuple(int(part) for part in (event.id or "").split(".")) for event in found]  # after[.skip]
    assert cursors == sorted(cursors) and len(set(cursors)) == 10
    assert read == 1  # the page that holds the chunk whose push was lost; every other chunk came pushed


async def test_a_watched_status_stream_reads_the_job_only_when_it_changed(gateway: Gateway, watched: Monitor) -> None:
    job_id = await submitted(gateway.http)  # queued for good: polled, its stream would ask every POLL_SECONDS
    async with gateway.http.stream("GET", "/api/v1/follow/status", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        stream = events(response)
        [queued] = await taken(stream, 1)
        assert queued.json()["status"] == "queued"
        await eventually(lambda: _watched(watched, job_id))
        await asyncio.sleep(follow.STATUS_RECHECK_SECONDS + 0.5)  # the changes of its submission read, and again
        quiet = gateway.calls.by_operation["get-job"]
        await asyncio.sleep(40 * POLL_SECONDS)
        assert gateway.calls.by_operation["get-job"] == quiet
        await stop(gateway.http, job_id)
        rest = await taken(stream)
    assert [(event.kind, event.json().get("status")) for event in rest] == [("status", "stopped"), ("end", None)]
    await eventually(lambda: _watched(watched, job_id, 0))  # the stream ended its watch as it closed


async def test_a_chunk_shipped_again_long_after_is_sent_once_paged_or_pushed(gateway: Gateway, watched: Monitor,
                                                                             nc: Client) -> None:
    job_id = await submitted(gateway.http)
    await publish_chunk(nc, job_id, 0, 0, ["first"])
    await publish_chunk(nc, job_id, 0, 0, ["first"], shipment=".again")  # read with the first page
    async with gateway.http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id},
                                   headers=as_user("alice")) as response:
        stream = events(response)
        assert lines_of(await taken(stream, 1)) == ["first"]
        await eventually(lambda: _watched(watched, job_id))
        await publish_chunk(nc, job_id, 0, 1, ["second"])
        await publish_chunk(nc, job_id, 0, 1, ["second"], shipment=".again")  # pushed
        await publish_chunk(nc, job_id, 0, 2, ["third"])
        assert lines_of(await taken(stream, 2)) == ["second", "third"]
