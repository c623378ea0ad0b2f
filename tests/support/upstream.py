"""Another service's events, published as its relay would, for a follower to read."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobStopped


async def publish_upstream(nc: Client, job_ids: list[str]) -> None:
    """A `JobStopped` of the scheduler's for each job, at positions 1, 2, ..."""
    for position, job_id in enumerate(job_ids, start=1):
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job",
                                 aggregate_id=job_id, version=1, position=position,
                                 recorded_at=datetime.now(UTC), event=JobStopped(job_id=job_id, by="bob"))
        await nc.jetstream().publish(subjects.event_subject("scheduler", "job", job_id, "JobStopped"),
                                     encode(envelope))
