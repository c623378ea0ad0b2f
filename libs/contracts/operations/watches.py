"""Watching a job (L9): what changes in it, and its new log chunks, pushed to the watcher as they happen.

A follower that polls asks its question again and again whether anything happened; a watch is asked once
and renewed now and then, and costs nothing while the job is quiet. `WatchJob` asks the monitor (which
follows every job's events and reads every log chunk as it is stored) to push into `inbox`, an inbox of
the caller's own connection:

- a `JobChanged` whenever one of the job's events is folded (its status, its instances): the watcher reads
  the job again where it reads it anyway;
- with `logs`, each new chunk as a `LogPushed`, with its position in the log stream and the position of the
  job's chunk before it (`previous`), so that a watcher sees at once when a push did not reach it (core NATS
  delivers at most once) and reads what it missed as a page (`GetJobLogs`, from where it was).

A watch lasts `Watching.seconds` unless asked for again (the same job and inbox renew it), and ends at once with
`end`. It is no record of the job's history: watches live in the monitor's memory, and a monitor that
restarts forgets them; a watcher that renews finds its watch gone (`Watching.since_now`) and reads a page to be
sure it missed nothing.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from libs.contracts.agent import LogChunk
from libs.contracts.operations.base import JobStatus, ReplyMessage, RequestMessage, people_operation

WATCH_SECONDS = 30.0  # a watch not asked for again within this long ends
# An inbox is `_INBOX.users.<user>.<token>…`: a subject of a few tokens, far shorter than this.
INBOX = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^_INBOX(\.[A-Za-z0-9_-]{1,64}){2,6}\Z")]
JOB_ID = r"^job-[0-9a-f]{12}\Z"


class WatchJob(RequestMessage, frozen=True, tag="WatchJob.v1"):
    """Push what happens to `job_id` into `inbox` (under the caller's own inbox prefix) for `Watching.seconds`;
    its new log chunks too with `logs`. Asked again, the watch is renewed (and `logs` changed); with `end`, it
    ends now."""

    job_id: Annotated[str, Meta(pattern=JOB_ID)]
    inbox: INBOX
    logs: bool = False
    end: bool = False


class Watching(ReplyMessage, frozen=True, tag="Watching.v1"):
    """The watch stands (or, after `end`, is gone): until `seconds` from now, the job's `status` as the monitor
    knows it, and, for a watch of logs, the position of the job's latest chunk the monitor has seen while
    the job was watched (None when none yet). `since_now`: the watch did not stand before this request (new,
    or forgotten by a restart), so what happened before it was not pushed."""

    job_id: str
    seconds: float
    status: JobStatus
    since_now: bool
    last_log: int | None = None


class LogPushed(Struct, frozen=True, kw_only=True, tag="LogPushed.v1", tag_field="type"):
    """A new chunk of a watched job's log, stored at `position` in the log stream; `previous` is the position of
    the job's chunk stored before it, as the monitor saw it while the job was watched (None: not known)."""

    job_id: str
    position: Annotated[int, Meta(ge=1)]
    previous: Annotated[int, Meta(ge=1)] | None
    chunk: LogChunk


class JobChanged(Struct, frozen=True, kw_only=True, tag="JobChanged.v1", tag_field="type"):
    """One of a watched job's events was folded; its status now."""

    job_id: str
    status: JobStatus


JobPush = LogPushed | JobChanged
MAX_PUSH_BYTES = 1024 * 1024  # as a reply: one NATS message at the server's default max payload

WATCH_JOB = people_operation(
    "watch-job", "trainyard.query.jobs.watch", WatchJob, Watching, "monitor", changes_state=False,
    summary="Have what happens to a job, and its new log chunks, pushed into an inbox of one's own.")
