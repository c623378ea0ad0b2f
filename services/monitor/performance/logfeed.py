"""The performance detector's input (M6): every job's log chunks, read as they stream.

A durable pull consumer on TRAINYARD_LOGS, created at new messages: past lines are not the
monitor's business. Only the chunks of jobs the detector watches are decoded, and only those published by
the node that runs their rank are fed to it (the subject's node, which NATS binds to the publishing agent). A batch is
acknowledged once what it opened is recorded; unacknowledged chunks come again, and a window that
sees some lines twice still records each incident once (see `rules.performance`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from libs.contracts import subjects
from libs.contracts.agent import LogChunk
from libs.contracts.codec import decode
from libs.telemetry.logs import get_logger
from services.monitor.performance.detector import Incident, PerformanceDetector

LOGS_PREFIX = "trainyard.logs."
LOG_BATCH = 256
log = get_logger(__name__)


async def follow_logs(js: JetStreamContext, consumer: str, detector: PerformanceDetector,
                      record: Callable[[list[Incident]], Awaitable[None]],
                      stored: Callable[[Sequence[Msg]], None] = lambda batch: None) -> None:
    """Feed every chunk to `detector` and `record` the incidents it opens, batch by batch, for good; each batch
    is also shown to `stored` first (the watchers of jobs' logs are pushed their chunks)."""
    config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.ALL)
    sub = await js.pull_subscribe(subjects.LOGS_ALL, durable=consumer, stream=subjects.LOGS_STREAM, config=config)
    log.info("performance.following", consumer=consumer)
    while True:
        try:
            batch = await sub.fetch(LOG_BATCH, timeout=5.0)
        except TimeoutError:  # nothing new (nats raises its own subclass, or the builtin)
            continue
        except NatsError as exc:  # a reconnect: the durable consumer is still there
            log.warning("performance.fetch_failed", error=repr(exc))
            await asyncio.sleep(1.0)
            continue
        if not batch:  # fetch may come back empty instead of timing out
            continue
        stored(batch)
        incidents = scan(detector, batch)
        if incidents:
            await record(incidents)
        # AckPolicy.ALL: acknowledging the last message acknowledges the whole batch.
        with contextlib.suppress(NatsError):
            await batch[-1].ack()


def scan(detector: PerformanceDetector, batch: Sequence[Msg]) -> list[Incident]:
    """The incidents a batch of log messages opens; chunks of jobs not watched are not decoded."""
    incidents: list[Incident] = []
    for msg in batch:
        job_id = msg.subject[len(LOGS_PREFIX):].partition(".")[0]
        if not detector.watching(job_id):
            continue
        try:
            chunk = decode(msg.data, LogChunk)
        except msgspec.DecodeError:
            continue
        # Only the node that runs the rank speaks for it: another node's lines would blame that node.
        if (why := subjects.sender_refusal(msg.subject, chunk.node) or detector.misplaced(chunk)) is not None:
            log.warning("performance.chunk_refused", subject=msg.subject, job_id=chunk.job_id, rank=chunk.rank,
                        node=chunk.node, reason=why)
            continue
        incidents += detector.feed(chunk)
    return incidents
