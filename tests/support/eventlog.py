"""An in-memory event log shared by fake event stores, and service runtimes on it: services run in the
test's process and what they record is read back from the log, numbered as the event stores do."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

from libs.contracts.events import EventEnvelope
from libs.eventstore import NewEvent, Tracking
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime

T0 = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)


class EventLog:
    """Every service's events in the order they were recorded, numbered as the event stores do."""

    def __init__(self) -> None:
        self.envelopes: list[EventEnvelope] = []
        self.versions: dict[tuple[str, str, str], int] = {}
        self.now = T0

    def record(self, service: str, aggregate_type: str, aggregate_id: str, event: Any) -> EventEnvelope:
        key = (service, aggregate_type, aggregate_id)
        self.versions[key] = self.versions.get(key, 0) + 1
        self.now += timedelta(seconds=1)
        envelope = EventEnvelope(event_id=f"e{len(self.envelopes) + 1}", service=service,
                                 aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                                 version=self.versions[key], position=len(self.envelopes) + 1,
                                 recorded_at=self.now, event=event)
        self.envelopes.append(envelope)
        return envelope

    def of(self, service: str, job_id: str) -> list[Any]:
        return [e.event for e in self.envelopes if e.service == service and e.aggregate_id == job_id]


class FakeStore:
    """One service's event store, appending to the shared log (versions checked as PostgreSQL would)."""

    def __init__(self, log: EventLog, service: str) -> None:
        self.log, self.service, self.schema, self.pool = log, service, service, None

    async def append(self, events: list[NewEvent], *, expected_versions: dict[tuple[str, str], int],
                     tracking: Tracking | None = None, trace: dict[str, str] | None = None) -> list[EventEnvelope]:
        for (aggregate_type, aggregate_id), version in expected_versions.items():
            assert self.log.versions.get((self.service, aggregate_type, aggregate_id), 0) == version
        return [self.log.record(self.service, new.aggregate_type, new.aggregate_id, new.event) for new in events]


def fake_runtime(log: EventLog, service: str, **settings: Any) -> ServiceRuntime:
    settings_ = Settings(auth_secret="unit-tests-" * 4, **settings)
    runtime = SimpleNamespace(settings=settings_, store=FakeStore(log, service), nc=None)
    return cast(ServiceRuntime, runtime)
