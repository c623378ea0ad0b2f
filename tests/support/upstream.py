"""Another service's events, published as its relay would, for a follower to read; and a service that follows
them, run until it has handled them."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TypeVar

from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobStopped
from libs.eventstore import EventStore
from libs.skeleton.eventsourced import EventSourcedService

S = TypeVar("S", bound=EventSourcedService)


async def publish_upstream(nc: Client, job_ids: list[str]) -> None:
    """A `JobStopped` of the scheduler's for each job, at positions 1, 2, ..."""
    for position, job_id in enumerate(job_ids, start=1):
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job",
                                 aggregate_id=job_id, version=1, position=position,
                                 recorded_at=datetime.now(UTC), event=JobStopped(job_id=job_id, by="bob"))
        await nc.jetstream().publish(subjects.event_subject("scheduler", "job", "JobStopped"),
                                     encode(envelope))


def stopped_envelope(job_id: str, position: int) -> EventEnvelope:
    """A scheduler's `JobStopped` at `position` of its log."""
    return EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job", aggregate_id=job_id,
                         version=1, position=position, recorded_at=datetime.now(UTC),
                         event=JobStopped(job_id=job_id, by="bob"))


async def publish_bundle(nc: Client, parts: Sequence[EventEnvelope | bytes], *, service: str = "scheduler",
                         aggregate_type: str = "job") -> int:
    """Envelopes (or any bytes in their place) published together as the relay publishes a bundle; its stream
    sequence."""
    body = b"[" + b",".join(part if isinstance(part, bytes) else encode(part) for part in parts) + b"]"
    ack = await nc.jetstream().publish(subjects.bundle_subject(service, aggregate_type), body)
    return ack.seq


async def followed(service: S, store: EventStore, tracked: int, *, settle: float = 0.0) -> S:
    """`service` rebuilt, its followers started and run until they have handled the scheduler's events up to
    `tracked` (at most a minute: the test's assertions say what was not handled), `settle` seconds more for what
    would come late, then stopped."""
    await service.rebuild()
    for upstream in service.upstreams():
        follower = service.follower(upstream)
        await follower.start()
        service.followers.append(follower)
    await asyncio.wait_for(service.caught_up(), 60)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            while await store.tracked_position("scheduler-events") < tracked:
                await asyncio.sleep(0.05)
    await asyncio.sleep(settle)
    for follower in service.followers:
        await follower.stop()
    return service
