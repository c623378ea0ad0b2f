"""One job's events read back from TRAINYARD_EVENTS by where they are stored (libs/messaging/history.py), on a real
NATS: what is noted and about the job, each once; nothing that is about another job; and, for events published
while subjects named the job, what was published under those subjects."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, NodeProcessStarted, PrecheckCompleted
from libs.contracts.ids import new_job_id
from libs.messaging.history import stored_events

pytestmark = pytest.mark.asyncio(loop_scope="session")
AT = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def launched(job_id: str) -> EventEnvelope:
    return EventEnvelope(event_id=str(uuid.uuid4()), service="launcher", aggregate_type="launch",
                         aggregate_id=job_id, version=1, position=1, recorded_at=AT,
                         event=NodeProcessStarted(job_id=job_id, attempt=1, rank=0, node="node-a", pid=7,
                                                  started_at=AT))


def checked(job_id: str) -> EventEnvelope:
    return EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="job", aggregate_id=job_id,
                         version=1, position=1, recorded_at=AT,
                         event=PrecheckCompleted(job_id=job_id, attempt=1, passed=True, nodes=[]))


async def publish(nc: Client, envelope: EventEnvelope, *, earlier: bool = False) -> int:
    name = type(envelope.event).name()
    subject = (subjects.earlier_event_subject(envelope.service, envelope.aggregate_type, envelope.aggregate_id, name)
               if earlier else subjects.event_subject(envelope.service, envelope.aggregate_type, name))
    ack = await nc.jetstream().publish(subject, encode(envelope), headers={"Nats-Msg-Id": envelope.event_id})
    return ack.seq


async def test_a_jobs_events_are_read_where_they_are_stored_and_only_its_own(nc: Client) -> None:
    job, other = new_job_id(), new_job_id()
    mine = [launched(job), checked(job)]
    where = [await publish(nc, envelope) for envelope in mine]
    elsewhere = await publish(nc, launched(other))
    missing = elsewhere + 1000  # never stored

    assert await stored_events(nc.jetstream(), [where[1], where[0], where[1]], job) == mine
    assert await stored_events(nc.jetstream(), [*where, elsewhere, missing], job) == mine
    assert await stored_events(nc.jetstream(), [elsewhere], job) == []


async def test_events_published_while_subjects_named_the_job_are_read_under_those_subjects(nc: Client) -> None:
    job, other = new_job_id(), new_job_id()
    mine = [launched(job), checked(job)]
    for envelope in mine:
        await publish(nc, envelope, earlier=True)
    await publish(nc, launched(other), earlier=True)
    await publish(nc, checked(job))  # on today's subject and noted nowhere: not found by the earlier subjects

    assert await stored_events(nc.jetstream(), [], job) == mine
    assert await stored_events(nc.jetstream(), [], "job-*") == []  # wildcards name no job
