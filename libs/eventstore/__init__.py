"""PostgreSQL event store and its outbox relay to JetStream."""

from libs.eventstore.relay import OutboxRelay
from libs.eventstore.store import AlreadyProcessed, ConcurrencyConflict, EventStore, NewEvent, Tracking

__all__ = ["AlreadyProcessed", "ConcurrencyConflict", "EventStore", "NewEvent", "OutboxRelay", "Tracking"]
