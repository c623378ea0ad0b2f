"""The follow streams (`GET /api/v1/follow/…`): a job's log, one of its metric series, its status, and the alerts,
as Server-Sent Events, for programs and for the console's pages (`EventSource`, with the session's cookie).

The streams of a job watch it (`watch.py`, `watch-job`): the monitor pushes the job's new log chunks and tells
when its events change it, so that a log or status stream reads the services only when something happened, and a
line reaches the caller as soon as the monitor reads it. A push that did not arrive shows as a gap in the
positions, and what is missing is read as a page. While the monitor does not take the watch, and for the metric
and alert streams, a stream polls the service that answers, acting as the caller, as the client's own followers do
(`client.api`: `logs`, `series`, `wait`, `alerts`), and sends what is new. What can be refused before it starts
(who calls, its query parameters, the first page, the limit of streams per token) is answered as a problem
(RFC 9457) instead of a stream; a refusal while it streams is an `error` event, and the stream closes. The events
of the log, metric and alert streams carry ids, so that a browser connecting again (`Last-Event-ID`) goes on after
the last event it received. A stream stops polling as soon as its caller leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from libs.contracts.jobspec import FieldError
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import TERMINAL_STATUSES, CommandError
from libs.contracts.operations.jobs import (
    GET_JOB,
    JOB_LOGS,
    ChunksOnce,
    GetJob,
    GetJobLogs,
    JobDetails,
    JobView,
    LogPage,
)
from libs.contracts.operations.runs import GET_SERIES, GetSeries, PointsOnce, SeriesPage
from libs.contracts.operations.watches import JobChanged, LogPushed
from libs.messaging.responder import error_for_decode_failure
from services.gateway.calls import Refused, UserCalls
from services.gateway.openapi import (
    FOLLOW_ALERTS,
    FOLLOW_LOGS,
    FOLLOW_METRICS,
    FOLLOW_STATUS,
    FollowEndpoint,
)
from services.gateway.problems import problem, problem_response
from services.gateway.sessions import Caller, Sessions, caller_of
from services.gateway.watch import Renewed, Watches

LOGS_POLL_SECONDS = 0.5  # while the job is not watched
METRICS_POLL_SECONDS = 1.0
STATUS_POLL_SECONDS = 1.0  # while the job is not watched
STATUS_GAP_SECONDS = 0.25  # a burst of changes (a node's instances starting one by one) is read once a quarter second
STATUS_RECHECK_SECONDS = 1.0  # and once more after the last, as the services fold what changed in their own time
ALERTS_POLL_SECONDS = 1.0
LOG_DRAIN_SECONDS = 1.0  # after the job ended, chunks still in flight may arrive for this long (as client.logs)
KEEP_ALIVE_SECONDS = 15.0  # a comment this often, so that proxies keep an idle stream open
MOST_STREAMS_PER_TOKEN = 20  # a page left open in many tabs cannot flood the services
KEEP_ALIVE = b": keep-alive\n\n"
END = b"event: end\ndata: {}\n\n"  # an event without data is never dispatched by an EventSource
LAST_EVENT_ID = "last-event-id"
CURSOR = re.compile(r"(\d{1,18})(?:\.(\d{1,9}))?")
LONGEST_NUMBER = 18

S = TypeVar("S", bound=msgspec.Struct)
Frames = AsyncGenerator[bytes, None]


def invalid(field: str, message: str, hint: str | None = None) -> Refused:
    return Refused(CommandError(code="invalid-request", message=f"{field}: {message}", hint=hint,
                                errors=[FieldError(field=field, message=message, hint=hint)]))


def frame(event: str, data: bytes, event_id: str | None = None) -> bytes:
    """One event. Its data is one line of JSON, which escapes every line break inside its strings: a raw one
    would end the `data:` line and let the rest pass for fields of the stream."""
    if b"\n" in data or b"\r" in data:
        raise ValueError("the data of an event must be one line")
    head = f"event: {event}\n" if event_id is None else f"event: {event}\nid: {event_id}\n"
    return head.encode() + b"data: " + data + b"\n\n"


def error_frame(error: CommandError, instance: str) -> bytes:
    return frame("error", msgspec.json.encode(problem(error, instance=instance)[1]))


# --- what a stream is asked for ---------------------------------------------------------------------------------


def query_request(request: Request, endpoint: FollowEndpoint) -> msgspec.Struct:
    """The query parameters as the endpoint's request type: only those it takes, each once, whole numbers as
    digits only; what is missing or out of range named as the HTTP API names a field."""
    kinds = {parameter.name: parameter.kind for parameter in endpoint.parameters}
    taken = ", ".join(kinds) or "none"
    values: dict[str, Any] = {}
    for name, value in request.query_params.multi_items():
        if name not in kinds:
            raise invalid(name, "is not a parameter of this stream", hint=f"it takes: {taken}")
        if name in values:
            raise invalid(name, "is given more than once")
        if kinds[name] is int:
            if not (value.isascii() and value.isdigit() and len(value) <= LONGEST_NUMBER):
                raise invalid(name, "must be a whole number, 0 or more")
            values[name] = int(value)
        else:
            values[name] = value
    try:
        return msgspec.convert(values, endpoint.request, strict=True)
    except msgspec.ValidationError as exc:
        raise Refused(error_for_decode_failure(exc)) from None


@dataclass(frozen=True)
class Cursor:
    """Where a paged stream goes on: the page asked from `after`, less its first `skip` items. An event's id is the
    cursor after it: the last item of a page stands at the page's `next_after`, the others inside their page."""

    after: int = 0
    skip: int = 0

    def __str__(self) -> str:
        return str(self.after) if self.skip == 0 else f"{self.after}.{self.skip}"

    @classmethod
    def resumed(cls, request: Request) -> Cursor:
        """Where the caller's last event left off (`Last-Event-ID`), or the start."""
        given = request.headers.get(LAST_EVENT_ID, "").strip()
        if not given:
            return cls()
        matched = CURSOR.fullmatch(given)
        if matched is None:
            raise invalid("Last-Event-ID", "is not the id of an event of this stream",
                          hint="send the id of the last event received, or none to start from the first")
        return cls(int(matched.group(1)), int(matched.group(2) or 0))


def numbered(items: Sequence[S], after: int, next_after: int, skip: int) -> list[tuple[S, Cursor]]:
    """The items of a page asked from `after` past the first `skip`, each with the cursor after it."""
    last = len(items) - 1
    return [(item, Cursor(next_after) if index == last else Cursor(after, index + 1))
            for index, item in enumerate(items) if index >= skip]


# --- how many streams a token holds ------------------------------------------------------------------------------


class StreamSlots:
    def __init__(self, most: int = MOST_STREAMS_PER_TOKEN) -> None:
        self.most = most
        self._open: dict[str, int] = {}  # digest of the token -> its streams open

    def open_with(self, token: str) -> int:
        return self._open.get(_digest(token), 0)

    def take(self, token: str) -> Callable[[], None]:
        """A slot for one more stream of `token` (refused past the limit), and what gives it back (once)."""
        key = _digest(token)
        if self._open.get(key, 0) >= self.most:
            raise Refused(CommandError(code="over-cap", message=f"{self.most} streams are open with this token "
                                       "already", hint="close a page or a stream that follows something"))
        self._open[key] = self._open.get(key, 0) + 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            left = self._open.get(key, 1) - 1
            if left:
                self._open[key] = left
            else:
                self._open.pop(key, None)

        return give_back


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# --- the response ------------------------------------------------------------------------------------------------


class EventStream(StreamingResponse):
    """Server-Sent Events from `frames`, a keep-alive comment between them, until the frames end or the caller
    leaves: then the frames are closed wherever they wait (a poll's sleep, a question to a service), whichever
    version of ASGI the server speaks, and `on_close` runs."""

    def __init__(self, frames: Frames, on_close: Callable[[], None]) -> None:
        # No proxy may hold the events back to send them in one piece (nginx: X-Accel-Buffering).
        super().__init__(frames, media_type="text/event-stream", headers={"x-accel-buffering": "no"})
        self.frames = frames
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(receive, send)
        finally:
            self.on_close()

    async def _stream(self, receive: Receive, send: Send) -> None:
        writing = asyncio.Lock()  # the frames and the keep-alive share the connection

        async def write(body: bytes) -> None:
            async with writing:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        producing = asyncio.create_task(self._produce(write))
        tasks = [producing, asyncio.create_task(_left(receive)), asyncio.create_task(_keep_alive(write))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.frames.aclose()
        if producing.cancelled():
            return  # the caller left, or the connection failed
        failure = producing.exception()
        if isinstance(failure, OSError):
            return  # a server of ASGI 2.4 tells a write to a closed connection so
        if failure is not None:
            raise failure
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _produce(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        async for body in self.frames:
            await write(body)


async def _left(receive: Receive) -> None:
    """Returns once the caller has gone."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _keep_alive(write: Callable[[bytes], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(KEEP_ALIVE_SECONDS)
        await write(KEEP_ALIVE)


# --- the streams -------------------------------------------------------------------------------------------------


class FollowStreams:
    def __init__(self, calls: UserCalls, sessions: Sessions) -> None:
        self.calls = calls
        self.sessions = sessions
        self.slots = StreamSlots()
        self.watches = Watches(calls)

    def routes(self) -> list[Route]:
        return [
            Route(FOLLOW_LOGS.path, self.logs, methods=["GET"]),
            Route(FOLLOW_METRICS.path, self.metrics, methods=["GET"]),
            Route(FOLLOW_STATUS.path, self.status, methods=["GET"]),
            Route(FOLLOW_ALERTS.path, self.alerts, methods=["GET"]),
        ]

    async def logs(self, request: Request) -> Response:
        return await self._open(request, FOLLOW_LOGS, self._logs)

    async def metrics(self, request: Request) -> Response:
        return await self._open(request, FOLLOW_METRICS, self._metrics)

    async def status(self, request: Request) -> Response:
        return await self._open(request, FOLLOW_STATUS, self._status)

    async def alerts(self, request: Request) -> Response:
        return await self._open(request, FOLLOW_ALERTS, self._alerts)

    async def _open(self, request: Request, endpoint: FollowEndpoint,
                    start: Callable[[Caller, Any, Cursor, str], Awaitable[Frames]]) -> Response:
        """The stream, or the problem that stops it before it starts. `start` asks for the first page (or view)
        and gives the frames that begin with it."""
        path = request.url.path
        try:
            caller = caller_of(request, self.sessions)  # a GET: a console session needs no CSRF token
            asked = query_request(request, endpoint)
            cursor = Cursor.resumed(request) if endpoint.resumable else Cursor()
            give_back = self.slots.take(caller.token)
            try:
                frames = await start(caller, asked, cursor, path)
            except BaseException:
                give_back()
                raise
        except Refused as refused:
            return problem_response(refused.error, path)
        return EventStream(frames, on_close=give_back)

    async def _ask(self, caller: Caller, operation: Any, request: msgspec.Struct) -> Any:
        """Asked as the caller; a console session signed out (or expired) meanwhile ends the stream."""
        self._signed_in(caller)
        return await self.calls.ask(operation, request, caller.token)

    def _signed_in(self, caller: Caller) -> None:
        if caller.session is not None and not self.sessions.is_open(caller.session):
            raise Refused(CommandError(code="unauthenticated", message="the console session has ended",
                                       hint="sign in again at /signin"))

    # Logs: each chunk as stored; after the job ended and a short drain, the end (as client.logs).

    async def _logs(self, caller: Caller, asked: GetJobLogs, cursor: Cursor, path: str) -> Frames:
        asked = msgspec.structs.replace(asked, after=cursor.after)
        first: LogPage = await self._ask(caller, JOB_LOGS, asked)
        return self._log_frames(caller, asked, first, cursor.skip, path)

    async def _log_frames(self, caller: Caller, asked: GetJobLogs, page: LogPage, skip: int, path: str) -> Frames:
        """`page` was read from `asked.after`; then each pushed chunk that follows the last one sent, and a page
        read whenever one may be missing (a gap, a watch new or standing again, the job's end)."""
        loop = asyncio.get_running_loop()
        drain_until: float | None = None
        known = read_known = 0  # the furthest position named by a push or the watch; when the page was read
        once = ChunksOnce()  # a chunk its agent shipped again long after is sent once
        try:
            async with self.watches.watch(caller.token, asked.job_id, logs=True) as watch:
                while True:
                    for chunk, after in numbered(page.chunks, asked.after, page.next_after, skip):
                        if once.first_time(chunk):
                            yield frame("log", msgspec.json.encode(chunk), str(after))
                    skip = 0
                    # A whole page covers every position pushed before it was read, whichever rank it asked for.
                    asked = msgspec.structs.replace(
                        asked, after=page.next_after if page.more else max(page.next_after, read_known))
                    if page.ended and not page.more:
                        if drain_until is None:
                            drain_until = loop.time() + LOG_DRAIN_SECONDS
                        elif loop.time() >= drain_until:
                            yield END
                            return
                        await asyncio.sleep(LOGS_POLL_SECONDS)
                    while not page.more and not page.ended:
                        arrival = await watch.next(None if watch.standing else LOGS_POLL_SECONDS)
                        self._signed_in(caller)
                        if isinstance(arrival, LogPushed):
                            known = max(known, arrival.position)
                            if arrival.position <= asked.after:
                                continue  # read in a page already
                            if arrival.previous is None or arrival.previous > asked.after:
                                break  # one is missing: read from where the stream is
                            if (asked.rank is None or arrival.chunk.rank == asked.rank) and once.first_time(
                                    arrival.chunk):
                                yield frame("log", msgspec.json.encode(arrival.chunk), str(arrival.position))
                            asked = msgspec.structs.replace(asked, after=arrival.position)
                        elif isinstance(arrival, JobChanged):
                            if arrival.status in TERMINAL_STATUSES:
                                break
                        elif isinstance(arrival, Renewed) and arrival.watching is not None:
                            watching = arrival.watching
                            known = max(known, watching.last_log or 0)
                            if watching.since_now or known > asked.after or watching.status in TERMINAL_STATUSES:
                                break
                        else:
                            break  # not watched: poll
                    read_known = known
                    page = await self._ask(caller, JOB_LOGS, asked)
        except Refused as refused:
            yield error_frame(refused.error, path)

    # Metrics: each point of the series once; once the job ended, one more page and the end (as client.series).

    async def _metrics(self, caller: Caller, asked: GetSeries, cursor: Cursor, path: str) -> Frames:
        asked = msgspec.structs.replace(asked, after=cursor.after)
        first: SeriesPage = await self._ask(caller, GET_SERIES, asked)
        return self._point_frames(caller, asked, first, cursor.skip, path)

    async def _point_frames(self, caller: Caller, asked: GetSeries, page: SeriesPage, skip: int, path: str) -> Frames:
        once = PointsOnce()
        ending = False
        try:
            async with self.watches.watch(caller.token, asked.job_id, read=False) as watch:
                while True:
                    for point, after in numbered(page.points, asked.after, page.next_after, skip):
                        if not once.first_time(point):
                            continue
                        yield frame("point", msgspec.json.encode(point), str(after))
                    skip = 0
                    asked = msgspec.structs.replace(asked, after=page.next_after)
                    if not page.more:
                        if ending:
                            yield END
                            return
                        if watch.standing and watch.status is not None:
                            status = watch.status
                        else:
                            details: JobDetails = await self._ask(caller, GET_JOB, GetJob(job_id=asked.job_id))
                            status = details.job.status
                        if status in TERMINAL_STATUSES:
                            ending = True  # one more page: what was logged before the end
                        else:
                            await asyncio.sleep(METRICS_POLL_SECONDS)
                    page = await self._ask(caller, GET_SERIES, asked)
        except Refused as refused:
            yield error_frame(refused.error, path)

    # Status: the job's view whenever what a follower watches changes; the end once the job ended.

    async def _status(self, caller: Caller, asked: GetJob, _: Cursor, path: str) -> Frames:
        first: JobDetails = await self._ask(caller, GET_JOB, asked)
        return self._status_frames(caller, asked, first.job, path)

    async def _status_frames(self, caller: Caller, asked: GetJob, job: JobView, path: str) -> Frames:
        """The view as first read; then read again when the watch says the job changed (at most every
        STATUS_GAP_SECONDS, and once more STATUS_RECHECK_SECONDS after the last change), or polled while the job is
        not watched."""
        loop = asyncio.get_running_loop()
        sent: tuple[object, ...] | None = None
        read_at = loop.time()
        due: float | None = None  # when to read for the changes pushed
        recheck: float | None = None
        try:
            async with self.watches.watch(caller.token, asked.job_id) as watch:
                while True:
                    watched = (job.status, job.reason, job.attempt, job.instances)
                    if watched != sent:
                        yield frame("status", msgspec.json.encode(job))
                        sent = watched
                    if job.status in TERMINAL_STATUSES:
                        yield END
                        return
                    while True:
                        now = loop.time()
                        if (due is not None and now >= due) or (recheck is not None and now >= recheck):
                            due = None
                            recheck = None if recheck is not None and now >= recheck else recheck
                            break
                        deadlines = [at - now for at in (due, recheck) if at is not None]
                        if not watch.standing:
                            deadlines.append(STATUS_POLL_SECONDS)
                        arrival = await watch.next(min(deadlines, default=None))
                        self._signed_in(caller)
                        now = loop.time()
                        if arrival is None:
                            if not watch.standing:
                                break  # not watched: poll
                        elif isinstance(arrival, JobChanged):
                            due = due if due is not None else max(now, read_at + STATUS_GAP_SECONDS)
                            recheck = now + STATUS_RECHECK_SECONDS
                        elif isinstance(arrival, Renewed):
                            watching = arrival.watching
                            if watching is None or watching.since_now or watching.status != job.status:
                                break
                    read_at = loop.time()
                    details: JobDetails = await self._ask(caller, GET_JOB, asked)
                    job = details.job
        except Refused as refused:
            yield error_frame(refused.error, path)

    # Alerts: every alert the caller may see, oldest first, then each new one; never ends (as client.alerts).

    async def _alerts(self, caller: Caller, asked: ListAlerts, cursor: Cursor, path: str) -> Frames:
        asked = msgspec.structs.replace(asked, after=cursor.after)
        first: AlertPage = await self._ask(caller, LIST_ALERTS, asked)
        return self._alert_frames(caller, asked, first, cursor.skip, path)

    async def _alert_frames(self, caller: Caller, asked: ListAlerts, page: AlertPage, skip: int, path: str) -> Frames:
        try:
            while True:
                for envelope, after in numbered(page.alerts, asked.after, page.next_after, skip):
                    yield frame("alert", msgspec.json.encode(envelope), str(after))
                skip = 0
                asked = msgspec.structs.replace(asked, after=page.next_after)
                if not page.more:
                    await asyncio.sleep(ALERTS_POLL_SECONDS)
                page = await self._ask(caller, LIST_ALERTS, asked)
        except Refused as refused:
            yield error_frame(refused.error, path)
