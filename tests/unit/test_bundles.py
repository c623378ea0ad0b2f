"""Bundles of events: which stored events the relay publishes together, how a bundle is read, and how a past state
takes one."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from libs.contracts import subjects
from libs.contracts.bundles import BUNDLE_BYTES, BUNDLE_EVENTS, stored_envelopes
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobStopped
from libs.eventstore.relay import bundles
from services.scheduler.history.past import FOR_NOW, _Source

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def row(xmin: int, aggregate_type: str = "job", data: str = "{}") -> dict[str, Any]:
    return {"xmin": xmin, "aggregate_type": aggregate_type, "data": data}


def grouped(rows: list[dict[str, Any]]) -> list[list[int]]:
    """The bundles, as the indexes of their rows."""
    index = {id(r): i for i, r in enumerate(rows)}
    return [[index[id(r)] for r in bundle] for bundle in bundles(rows)]  # type: ignore[arg-type]


def test_one_appends_consecutive_events_of_one_kind_of_aggregate_go_together() -> None:
    rows = [row(1), row(1), row(1, "node"), row(1), row(2), row(2), row(3, "settings")]
    assert grouped(rows) == [[0, 1], [2], [3], [4, 5], [6]]


def test_set_aside_records_go_alone_for_the_monitor_follows_them_by_their_name() -> None:
    rows = [row(1, subjects.SET_ASIDE_AGGREGATE), row(1, subjects.SET_ASIDE_AGGREGATE), row(1)]
    assert grouped(rows) == [[0], [1], [2]]


def test_a_bundle_is_bounded_in_events_and_in_bytes() -> None:
    assert [len(b) for b in grouped([row(1) for _ in range(BUNDLE_EVENTS * 2 + 1)])] == [BUNDLE_EVENTS] * 2 + [1]
    third = "x" * (BUNDLE_BYTES // 3)
    assert [len(b) for b in grouped([row(1, data=third) for _ in range(7)])] == [2, 2, 2, 1]
    assert grouped([row(1, data="x" * BUNDLE_BYTES), row(1)]) == [[0], [1]]  # a larger event alone


def envelope(position: int, at: datetime, aggregate_type: str = "job") -> EventEnvelope:
    return EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type=aggregate_type,
                         aggregate_id=f"job-{position}", version=1, position=position, recorded_at=at,
                         event=JobStopped(job_id=f"job-{position}", by="bob"))


def test_a_bundles_envelopes_are_read_one_by_one_and_one_that_does_not_decode_is_left_out() -> None:
    first, last = envelope(1, T0), envelope(3, T0)
    body = b"[" + encode(first) + b',{"event_id": "e", "type": "JobTeleported.v1"},' + encode(last) + b"]"
    assert stored_envelopes(subjects.bundle_subject("scheduler", "job"), body) == [first, last]
    assert stored_envelopes(subjects.event_subject("scheduler", "job", "JobStopped"), encode(first)) == [first]
    assert stored_envelopes(subjects.bundle_subject("scheduler", "job"), encode(first)) == []  # not an array
    assert stored_envelopes(subjects.event_subject("scheduler", "job", "JobStopped"), body) == []


@pytest.mark.parametrize(("subject", "bundle"), [
    ("trainyard.events.scheduler.job.bundle", True),
    ("trainyard.events.scheduler.job.JobStopped", False),
    ("trainyard.events.scheduler.job.job-1.bundle", False),  # an earlier event subject of a job named so
    ("trainyard.logs.job-1.bundle", False),
])
def test_a_bundle_is_told_by_its_subject(subject: str, bundle: bool) -> None:
    assert subjects.is_bundle(subject) is bundle


async def test_a_past_state_takes_a_bundle_whole_at_the_instant_its_last_event_was_recorded() -> None:
    """The events one append recorded are folded together: an instant between two of them has neither."""
    bundle = [envelope(2, T0 + timedelta(seconds=1)), envelope(3, T0 + timedelta(seconds=3))]
    read = [(7, [envelope(1, T0)]), (9, bundle), (10, [])]  # the last: passed over by the live service

    async def open_after(after: int) -> AsyncIterator[tuple[int, list[EventEnvelope]]]:
        for position, envelopes in read:
            if position > after:
                yield position, envelopes
        yield FOR_NOW, []

    source = _Source("trainyard.events.launcher.launch.>", open_after)
    assert [e.position for e in await source.until(T0 + timedelta(seconds=2))] == [1]
    assert source.after == 7
    assert [e.position for e in await source.until(T0 + timedelta(seconds=3))] == [2, 3]
    assert source.after == 10
