"""A follow stream's watch of a job (`watch-job`): the monitor pushes the job's changes, and its new log chunks,
into an inbox of the caller's own connection, so that a stream reads the services only when something happened.

The watch is asked for as the caller (the monitor checks the caller may view the job, and that the inbox is the
caller's own), renewed every `RENEW_SECONDS`, and ended when the stream closes. While the monitor does not take
it (away, restarting, or not yet aware of a job just submitted), the stream polls as it did before watches, and
the watch is asked for again every `RETRY_SECONDS`. What arrives is read in order with `next`: each push, and
after each request for the watch a `Renewed` that says whether it stands.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.contracts.codec import decode_any
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.watches import (
    MAX_PUSH_BYTES,
    WATCH_JOB,
    JobChanged,
    JobPush,
    LogPushed,
    Watching,
    WatchJob,
)
from libs.telemetry.logs import get_logger
from services.gateway.calls import Refused, UserCalls

log = get_logger(__name__)

RENEW_SECONDS = 10.0  # a third of the watch's life: one renewal lost still leaves it standing
RETRY_SECONDS = 2.0
END_SECONDS = 2.0  # how long ending a watch may take, in the background, once its stream closed
MOST_WAITING = 1000  # pushes not read yet; beyond, dropped (a log stream sees the gap and reads a page)


@dataclass(frozen=True)
class Renewed:
    """The watch was asked for: what the monitor answered, or None when it did not take it (`refusal`, or away)."""

    watching: Watching | None
    refusal: CommandError | None = None


Arrival = LogPushed | JobChanged | Renewed


class JobWatch:
    """One stream's watch: `standing` while the monitor pushes, `status` the job's as last heard from it."""

    def __init__(self, calls: UserCalls, token: str, job_id: str, *, logs: bool, read: bool) -> None:
        self.calls = calls
        self.token = token
        self.job_id = job_id
        self.logs = logs
        self.read = read  # whether `next` is read; if not, only `standing` and `status` are kept
        self.inbox = ""
        self.standing = False
        self.closed = False
        self.status: str | None = None
        self.arrivals: asyncio.Queue[Arrival] = asyncio.Queue(MOST_WAITING)

    async def next(self, timeout: float | None) -> Arrival | None:
        """What arrived next, or None after `timeout` seconds of nothing."""
        try:
            return await asyncio.wait_for(self.arrivals.get(), timeout)
        except TimeoutError:
            return None

    def _arrived(self, arrival: Arrival) -> None:
        if isinstance(arrival, JobChanged):
            self.status = arrival.status
        elif isinstance(arrival, Renewed) and arrival.watching is not None:
            self.status = arrival.watching.status
        if not self.read:
            return
        with contextlib.suppress(asyncio.QueueFull):
            self.arrivals.put_nowait(arrival)

    async def _pushed(self, msg: Msg) -> None:
        if len(msg.data) > MAX_PUSH_BYTES:
            return
        try:
            push = decode_any(msg.data, JobPush)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("gateway.push_undecodable", job_id=self.job_id, size=len(msg.data))
            return
        if push.job_id == self.job_id:
            self._arrived(push)

    async def _ask(self, end: bool = False) -> Watching:
        request = WatchJob(job_id=self.job_id, inbox=self.inbox, logs=self.logs, end=end)
        watching: Watching = await self.calls.ask(WATCH_JOB, request, self.token)
        return watching

    async def _renew(self) -> None:
        """Ask for the watch until the stream closes, then end it. The stream's closing is a flag as well as a
        cancellation: `asyncio.wait_for` (nats-py's request) returns a reply that came as it was cancelled."""
        try:
            while not self.closed:
                try:
                    watching: Watching | None = await self._ask()
                    refusal = None
                except Refused as refused:
                    watching, refusal = None, refused.error
                self.standing = watching is not None
                self._arrived(Renewed(watching, refusal))
                await asyncio.sleep(RENEW_SECONDS if self.standing else RETRY_SECONDS)
        finally:
            if self.standing:  # the monitor stops pushing at once, instead of when the watch runs out
                with contextlib.suppress(Refused, TimeoutError):
                    await asyncio.wait_for(self._ask(end=True), END_SECONDS)


class Watches:
    """The watches of the open streams."""

    def __init__(self, calls: UserCalls) -> None:
        self.calls = calls
        self._renewing: set[asyncio.Task[None]] = set()  # of the open streams, and of those ending their watch

    @contextlib.asynccontextmanager
    async def watch(self, token: str, job_id: str, *, logs: bool = False, read: bool = True) -> AsyncIterator[JobWatch]:
        """A watch of `job_id` for as long as the block runs, on the token's own connection (held open); with
        `logs`, of its log too; `read`: whether what arrives is read (`JobWatch.next`), else only its status."""
        watch = JobWatch(self.calls, token, job_id, logs=logs, read=read)
        async with self.calls.held(token) as nc:
            subscription = await self._subscribe(nc, watch)
            renewing = asyncio.create_task(watch._renew())
            self._renewing.add(renewing)
            renewing.add_done_callback(self._renewing.discard)
            try:
                yield watch
            finally:
                watch.closed = True  # the watch ends in the background: the stream is closing already
                renewing.cancel()
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    @staticmethod
    async def _subscribe(nc: Client, watch: JobWatch) -> Subscription:
        watch.inbox = nc.new_inbox()
        return await nc.subscribe(watch.inbox, cb=watch._pushed)
