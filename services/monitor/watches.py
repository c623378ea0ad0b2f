"""Watches of jobs (L9, `watch-job`): what happens to a job, and its new log chunks, pushed to those who watch it.

The monitor folds every job event and reads every log chunk as it is stored (`performance.logfeed`), so it can
tell a watcher the moment something happens instead of being asked every half second whether it did: a follow
stream of the gateway costs the control plane one renewal every few seconds, and a chunk reaches it as soon
as the monitor reads it. `Watches` is the pure part (who watches what, until when; `now` is given);
`JobWatching` answers `watch-job` and sends the pushes. Pushes are queued and sent by one loop, so that a fold,
which does no I/O, can push too; a queue that overflows drops pushes, which a watcher notices (`previous`, or
its renewal's `last_log`) and reads as a page.

A watch is a subscription, not state of the platform: it lives in memory only, for `WATCH_SECONDS` unless
renewed, and a monitor that restarts starts with none (the watcher's renewal says `since_now`). An archived job's
watches end with its archival; one asked for afterwards stands with the status read back (`archive`), and nothing
comes of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts.agent import LogChunk
from libs.contracts.codec import decode, encode
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.watches import (
    MAX_PUSH_BYTES,
    WATCH_JOB,
    WATCH_SECONDS,
    JobChanged,
    LogPushed,
    Watching,
    WatchJob,
)
from libs.jobstatus import JobLifecycle
from libs.messaging.responder import Route
from libs.natsroles import inbox_prefix, user_nats_name
from libs.telemetry.logs import get_logger
from services.monitor.runs.archive import PastJobs, events_unavailable, job_to_answer

log = get_logger(__name__)

MOST_PER_USER = 200  # ten console pages and their programs; the gateway holds 20 streams per token
MOST = 50_000  # all people together: a bound on the monitor's memory (a watch is a few hundred bytes)
MOST_QUEUED = 10_000  # pushes waiting for the loop that sends them; beyond, dropped (watchers read a page)
SWEEP_SECONDS = 10.0
LOGS_PREFIX = "trainyard.logs."  # trainyard.logs.<job>.<rank>.<node>


@dataclass
class Watch:
    job_id: str
    inbox: str
    user: str
    logs: bool
    until: float  # monotonic seconds


class Watches:
    """The watches standing, by job, and for each job watched with its logs the position of its latest chunk seen
    since (`previous` of the next push)."""

    def __init__(self, most_per_user: int = MOST_PER_USER, most: int = MOST) -> None:
        self.most_per_user = most_per_user
        self.most = most
        self.by_job: dict[str, dict[str, Watch]] = {}  # job -> inbox -> its watch
        self.per_user: Counter[str] = Counter()
        self.last_log: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(self.per_user.values())

    def ask(self, request: WatchJob, user: str, now: float) -> bool | CommandError:
        """Stand, renew or (`end`) end a watch: whether it did not stand before, or why it cannot stand."""
        standing = self.by_job.get(request.job_id, {}).get(request.inbox)
        if standing is not None and standing.user != user:  # inboxes are the caller's own: this cannot be
            return CommandError(code="forbidden", message="that inbox is watched by someone else")
        if request.end:
            if standing is not None:
                self._remove(standing)
            return standing is None
        if standing is not None:
            standing.until, standing.logs = now + WATCH_SECONDS, request.logs
            return False
        if self.per_user[user] >= self.most_per_user or len(self) >= self.most:
            return CommandError(code="over-cap", message=f"{self.per_user[user]} watches stand for you already"
                                if self.per_user[user] >= self.most_per_user else "the monitor holds all the "
                                "watches it can", hint="close follow streams you no longer read, or poll instead")
        self.by_job.setdefault(request.job_id, {})[request.inbox] = Watch(
            job_id=request.job_id, inbox=request.inbox, user=user, logs=request.logs, until=now + WATCH_SECONDS)
        self.per_user[user] += 1
        return True

    def of(self, job_id: str) -> list[Watch]:
        return list(self.by_job.get(job_id, {}).values())

    def logs_watched(self, job_id: str) -> bool:
        return any(watch.logs for watch in self.by_job.get(job_id, {}).values())

    def saw_log(self, job_id: str, position: int) -> int | None:
        """Note the job's chunk at `position`; the position of the one before it, when seen while watched."""
        previous = self.last_log.get(job_id)
        if previous is None or position > previous:
            self.last_log[job_id] = position
        return previous

    def forget(self, job_id: str) -> None:
        for watch in self.of(job_id):
            self._remove(watch)

    def sweep(self, now: float) -> None:
        for watches in list(self.by_job.values()):
            for watch in list(watches.values()):
                if watch.until <= now:
                    self._remove(watch)

    def _remove(self, watch: Watch) -> None:
        watches = self.by_job.get(watch.job_id, {})
        watches.pop(watch.inbox, None)
        self.per_user[watch.user] -= 1
        if self.per_user[watch.user] <= 0:
            del self.per_user[watch.user]
        if not watches:
            self.by_job.pop(watch.job_id, None)
        if not self.logs_watched(watch.job_id):
            self.last_log.pop(watch.job_id, None)


def inbox_refusal(inbox: str, identity: Identity) -> CommandError | None:
    """Pushes go only into the caller's own inbox, which only its own connection may read."""
    own = inbox_prefix(user_nats_name(identity.user)) + "."
    if inbox.startswith(own):
        return None
    return CommandError(code="forbidden", message=f"inbox: {inbox!r} is not an inbox of yours",
                        hint=f"name a subject under {own[:-1]}, the inbox prefix your connection reads")


class JobWatching:
    """Answers `watch-job` for those who may view the job, and pushes to its watchers what the monitor sees."""

    def __init__(self, nc: Client, jobs: JobLifecycle, past: PastJobs | None = None) -> None:
        self.nc = nc
        self.jobs = jobs
        self.past = past  # jobs archived, read back when asked about
        self.watches = Watches()
        self.queued: list[tuple[str, bytes]] = []
        self.ready = asyncio.Event()

    def routes(self) -> list[Route]:
        return [(WATCH_JOB, self.watch)]

    async def watch(self, request: WatchJob, identity: Identity) -> Watching | CommandError:
        try:
            found = await job_to_answer(self.jobs, self.past, request.job_id, identity)
        except (nats.errors.Error, OSError) as exc:
            return events_unavailable(exc)
        if found is None:
            return CommandError(code="not-found", message=f"no such job: {request.job_id}",
                                hint="`trainyard list` shows the jobs you can see")
        job, _ = found
        if refusal := inbox_refusal(request.inbox, identity):
            return refusal
        asked = self.watches.ask(request, identity.user, time.monotonic())
        if isinstance(asked, CommandError):
            return asked
        return Watching(job_id=job.job_id, seconds=0.0 if request.end else WATCH_SECONDS, status=job.status,
                        since_now=asked, last_log=self.watches.last_log.get(job.job_id))

    # --- what is pushed ------------------------------------------------------------------------------------------

    def changed(self, job_id: str) -> None:
        """One of the job's events was folded: its watchers are told its status; a deleted job's watches end (a
        renewal then finds no such job)."""
        watches = self.watches.of(job_id)
        job = self.jobs.jobs.get(job_id)
        if not watches or job is None:
            return
        data = encode(JobChanged(job_id=job_id, status=job.status))
        for watch in watches:
            self._queue(watch.inbox, data)
        if job.deleted:
            self.watches.forget(job_id)

    def forget(self, job_id: str) -> None:
        """The job was archived: its watches end (a renewal stands again, on the job as read back)."""
        self.watches.forget(job_id)

    def stored(self, batch: Sequence[Msg]) -> None:
        """Log chunks as stored (the monitor's log consumer): each of a job watched with its logs, to its
        watchers of logs. Another node's chunk reaches them as it reaches a page (`job-logs`)."""
        for msg in batch:
            job_id = msg.subject.removeprefix(LOGS_PREFIX).split(".", 1)[0]
            if not self.watches.logs_watched(job_id):
                continue
            position = msg.metadata.sequence.stream
            previous = self.watches.saw_log(job_id, position)
            if previous is not None and position <= previous:
                continue  # delivered again: pushed already
            try:
                chunk = decode(msg.data, LogChunk)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a page passes it over too; the next push's `previous` still names this position
            data = encode(LogPushed(job_id=job_id, position=position, previous=previous, chunk=chunk))
            if len(data) > min(MAX_PUSH_BYTES, self.nc.max_payload):
                continue  # too large to push: the watcher sees the gap and reads it as a page, cut to fit
            for watch in self.watches.of(job_id):
                if watch.logs:
                    self._queue(watch.inbox, data)

    def _queue(self, inbox: str, data: bytes) -> None:
        if len(self.queued) >= MOST_QUEUED:
            return  # dropped: the watcher reads what it missed as a page
        self.queued.append((inbox, data))
        self.ready.set()

    # --- the loops -----------------------------------------------------------------------------------------------

    async def send(self) -> None:
        """Send what is queued, for good. NATS away: what is queued meanwhile is dropped, the watchers read pages."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            queued, self.queued = self.queued, []
            for inbox, data in queued:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await self.nc.publish(inbox, data)

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            self.watches.sweep(time.monotonic())
