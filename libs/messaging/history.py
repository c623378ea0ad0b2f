"""One job's events read back from TRAINYARD_EVENTS by where they are stored.

Event subjects name the service, the kind of aggregate and the event, not the aggregate (libs/contracts/subjects.py):
a job's events cannot be picked out by a subject filter. A service that follows another's events about jobs notes
the stream sequence of each as it folds it, and reads them back by those sequences when a job's history is asked
for. Each message is fetched on its own (JetStream's message get, a few at a time) and kept only when it is what
was noted: an event about that job, consistent with where it was published (of a bundle, `subjects.bundle_subject`,
the events about that job). A stream made anew since (JetStream
lost it, and the relays published every log again) holds other messages at those sequences, or none: those are
left out, never shown as the job's.

A job whose events were published while subjects named the aggregate (`subjects.earlier_event_subject`) has none
noted: its events are read by the subject filter they were published under, as they were then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable

from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from libs.contracts.bundles import stored_envelopes
from libs.contracts.events import EventEnvelope
from libs.contracts.ids import is_job_id
from libs.contracts.subjects import EVENTS_STREAM, earlier_events_of_job
from libs.messaging.follower import inconsistency
from libs.messaging.reader import read_subject

GETS_AT_ONCE = 32


async def stored_events(js: JetStreamContext, sequences: Iterable[int], about: str) -> list[EventEnvelope]:
    """The events about job `about` stored at `sequences` of TRAINYARD_EVENTS (none: those published under the
    earlier subjects), in stream order, each once. JetStream away raises."""
    wanted = sorted(set(sequences))
    if not wanted:
        return await _published_earlier(js, about) if is_job_id(about) else []
    limit = asyncio.Semaphore(GETS_AT_ONCE)

    async def one(sequence: int) -> list[EventEnvelope]:
        async with limit:
            try:
                msg = await js.get_msg(EVENTS_STREAM, seq=sequence)
            except NotFoundError:  # removed, or a stream made anew and shorter
                return []
        return _about(msg.data or b"", msg.subject or "", about)

    return _once(itertools.chain.from_iterable(await asyncio.gather(*(one(sequence) for sequence in wanted))))


async def _published_earlier(js: JetStreamContext, job_id: str) -> list[EventEnvelope]:
    found: list[EventEnvelope] = []
    async with contextlib.aclosing(read_subject(js, EVENTS_STREAM, earlier_events_of_job(job_id))) as msgs:
        async for msg in msgs:
            found.extend(_about(msg.data, msg.subject, job_id))
    return _once(found)


def _once(envelopes: Iterable[EventEnvelope]) -> list[EventEnvelope]:
    """Each event once (a relay may publish one again after a crash), in the order given."""
    seen: set[str] = set()
    events: list[EventEnvelope] = []
    for envelope in envelopes:
        if envelope.event_id not in seen:
            seen.add(envelope.event_id)
            events.append(envelope)
    return events


def _about(data: bytes, subject: str, about: str) -> list[EventEnvelope]:
    """The events of a message about `about`, each consistent with where it was published."""
    return [envelope for envelope in stored_envelopes(subject, data)
            if envelope.aggregate_id == about and inconsistency(envelope, subject, None) is None]
