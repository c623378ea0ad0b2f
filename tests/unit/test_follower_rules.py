"""What a follower accepts from a stream, and which failures it waits out rather than sets aside."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg
import nats.errors
import pytest

from libs.contracts.events import EventEnvelope, JobSucceeded
from libs.eventstore import ConcurrencyConflict
from libs.messaging.follower import claims, classify, inconsistency


@pytest.mark.parametrize("error", [
    OSError("connection refused"), ConnectionResetError(), TimeoutError(),
    asyncpg.exceptions.ConnectionDoesNotExistError("closed"), asyncpg.exceptions.CannotConnectNowError("starting"),
    asyncpg.exceptions.InterfaceError("pool is closing"), asyncpg.exceptions.TooManyConnectionsError("full"),
    nats.errors.TimeoutError(), nats.errors.ConnectionClosedError(), nats.errors.NoServersError(),
])
def test_an_outage_of_postgresql_or_nats_is_waited_out(error: BaseException) -> None:
    assert classify(error) == "transient"


def test_a_conflict_is_set_aside_at_once_and_other_errors_after_a_few_tries() -> None:
    assert classify(ConcurrencyConflict("job j is past version 3")) == "conflict"
    assert classify(KeyError("job")) == "unknown"
    assert classify(asyncpg.exceptions.UniqueViolationError("duplicate")) == "unknown"


def envelope(service: str, job_id: str = "job-000000000001") -> EventEnvelope:
    return EventEnvelope(event_id=str(uuid.uuid4()), service=service, aggregate_type="job", aggregate_id=job_id,
                         version=1, position=1, recorded_at=datetime.now(UTC), event=JobSucceeded(job_id=job_id))


def test_an_envelope_is_accepted_only_on_its_own_subject_from_the_service_followed() -> None:
    genuine = "trainyard.events.scheduler.job.JobSucceeded"
    assert inconsistency(envelope("scheduler"), genuine, "scheduler") is None
    assert inconsistency(envelope("scheduler"), genuine, None) is None
    # A scheduler event on a monitor subject; a monitor-claiming event on the scheduler's subject.
    forged = "trainyard.events.monitor.job.JobSucceeded"
    assert "claims service 'scheduler'" in (inconsistency(envelope("scheduler"), forged, "monitor") or "")
    assert "belongs on" in (inconsistency(envelope("scheduler"), forged, None) or "")
    assert inconsistency(envelope("monitor"), genuine, "scheduler") is not None
    # Another event name, or another kind of aggregate, in the subject.
    assert inconsistency(envelope("scheduler"), genuine.replace("JobSucceeded", "JobFailed"), "scheduler") is not None
    assert inconsistency(envelope("scheduler"), genuine.replace(".job.", ".launch."), "scheduler") is not None


def test_an_event_published_while_subjects_named_its_aggregate_is_read_where_it_was_published() -> None:
    earlier = "trainyard.events.scheduler.job.job-000000000001.JobSucceeded"
    assert inconsistency(envelope("scheduler"), earlier, "scheduler") is None
    assert inconsistency(envelope("scheduler", "job-000000000002"), earlier, "scheduler") is not None
    assert inconsistency(envelope("scheduler"), earlier.replace("JobSucceeded", "JobFailed"), "scheduler") is not None


def test_what_an_unreadable_message_claims_is_kept_when_it_reads_as_json() -> None:
    assert claims(b'{"service": "scheduler", "event": {"type": "JobTeleported.v1"}}') == ("scheduler",
                                                                                        "JobTeleported.v1")
    assert claims(b'{"type": "ProcessStarted.v9"}') == (None, "ProcessStarted.v9")
    assert claims(b"\x00garbage") == (None, None)
    assert claims(b'{"service": 7}') == (None, None)
