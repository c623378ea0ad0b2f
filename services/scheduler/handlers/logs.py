"""L9 through the scheduler: a job's log pages and resource samples, for callers who may view it (J2).

Users need no JetStream rights: the scheduler reads the log stream and the usage bucket for them.
Every read asks the stream for the next message at or after a sequence on the job's own subject
filter (`$JS.API.STREAM.MSG.GET` with `next_by_subj`), so the server finds it through its subject
index and never hands over another job's messages; no consumer is created, so a client polling a
followed log costs one small request per empty poll.
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from libs.contracts import subjects
from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.codec import decode, encode
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JOB_LOGS, JOB_USAGE, GetJobLogs, GetJobUsage, JobUsage, LogPage
from libs.messaging.reader import next_stored
from libs.messaging.responder import Route
from libs.telemetry.logs import get_logger
from services.scheduler.domain.access import access_error
from services.scheduler.history.archived import Archive
from services.scheduler.interfaces import Jobs

log = get_logger(__name__)

# Room in a reply for its own fields around the chunks.
REPLY_OVERHEAD = 4096
# A day of one job's usage keys (attempts x ranks); more would be a runaway restart loop.
MAX_USAGE_KEYS = 10_000


def unavailable(what: str, exc: Exception) -> CommandError:
    return CommandError(code="unavailable", message=f"the {what} did not answer ({type(exc).__name__})",
                        hint="JetStream may be restarting; try again")


class JobLogs:
    def __init__(self, scheduler: Jobs, *, nc: Client, js: JetStreamContext, archive: Archive) -> None:
        self.scheduler = scheduler
        self.nc, self.js = nc, js
        self.archive = archive  # an archived job's logs are read as a live one's

    def routes(self) -> list[Route]:
        return [(JOB_LOGS, self.logs), (JOB_USAGE, self.usage)]

    async def logs(self, request: GetJobLogs, identity: Identity) -> LogPage | CommandError:
        state = await self.archive.holding(request.job_id)
        if error := access_error(state, [request.job_id], identity, "view"):
            return error
        # Seen before reading: whatever the job wrote before it ended is in the stream by now.
        ended = state.jobs[request.job_id].terminal
        subject = subjects.job_logs(request.job_id, "*" if request.rank is None else request.rank)
        largest = self.nc.max_payload - REPLY_OVERHEAD
        budget = min(request.max_bytes, largest // 2)
        chunks: list[LogChunk] = []
        size, position, more = 0, request.after, False
        try:
            while (msg := await next_stored(self.js, subjects.LOGS_STREAM, subject, position)) is not None:
                data = msg.data or b""
                if len(chunks) == request.max_chunks or (chunks and size + len(data) > budget):
                    more = True  # left for the next page, which starts before it
                    break
                position = msg.seq or position + 1
                chunk = self._chunk(msg, data, largest)
                if chunk is not None:
                    chunks.append(chunk)
                    size += len(data)
        except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as exc:
            return unavailable("log stream", exc)
        return LogPage(chunks=chunks, next_after=position, more=more, ended=ended)

    def _chunk(self, msg: RawStreamMsg, data: bytes, largest: int) -> LogChunk | None:
        try:
            chunk = decode(data, LogChunk)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            # A chunk this version cannot read (a newer agent's) is passed over, not a failed page.
            log.warning("logs.undecodable_chunk", subject=msg.subject, sequence=msg.seq, error=str(exc))
            return None
        if len(data) <= largest:
            return chunk
        # Stored chunks fit the server's max payload, but not always with a reply around them.
        kept, excess = list(chunk.lines), len(data) - (largest - 256)  # 256: room for the notice
        while kept and excess > 0:
            excess -= len(encode(kept.pop())) + 1
        dropped = len(chunk.lines) - len(kept)
        log.warning("logs.chunk_cut", job_id=chunk.job_id, rank=chunk.rank, sequence=msg.seq, dropped=dropped)
        notice = f"[trainyard] {dropped} more line(s) of this chunk were left out: too large for one reply"
        return msgspec.structs.replace(chunk, lines=[*kept, notice])

    async def usage(self, request: GetJobUsage, identity: Identity) -> JobUsage | CommandError:
        if error := access_error(await self.archive.holding(request.job_id), [request.job_id], identity, "view"):
            return error
        # The bucket keeps one value per key, so reading the job's keys in order reads each latest sample.
        samples: list[UsageSample] = []
        position = 0
        try:
            for _ in range(MAX_USAGE_KEYS):
                msg = await next_stored(self.js, subjects.USAGE_STREAM, subjects.usage_of_job(request.job_id), position)
                if msg is None:
                    break
                position = msg.seq or position + 1
                if not msg.data:  # a deleted or purged key leaves a marker without a value
                    continue
                try:
                    samples.append(decode(msg.data, UsageSample))
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.warning("usage.undecodable_sample", subject=msg.subject, error=str(exc))
        except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as exc:
            return unavailable("usage bucket", exc)
        latest = max((s.attempt for s in samples), default=0)
        return JobUsage(samples=sorted((s for s in samples if s.attempt == latest), key=lambda s: s.rank))
