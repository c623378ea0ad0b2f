"""A follower's handler as a service's: it folds each event and answers it with one event of its own, recorded with the
event's tracking position."""

from __future__ import annotations

import asyncio

import asyncpg
from nats.aio.msg import Msg

from libs.contracts.events import EventEnvelope, NodeRecovered
from libs.eventstore import EventStore, NewEvent, Tracking


class Reactor:
    """Folds every event (its aggregate id, in `folded`) and answers it with a `NodeRecovered` of that id.

    `outages`: per aggregate id, how many connection errors its handling raises first; `hold`: an aggregate id whose
    handling waits until `go_on` is set."""

    def __init__(self, store: EventStore, hold: str | None = None) -> None:
        self.store = store
        self.folded: list[str] = []
        self.outages: dict[str, int] = {}
        self.hold = hold
        self.go_on = asyncio.Event()

    async def handle(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        if envelope.aggregate_id == self.hold:
            await self.go_on.wait()
        if self.outages.get(envelope.aggregate_id, 0) > 0:
            self.outages[envelope.aggregate_id] -= 1
            raise asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation")
        self.folded.append(envelope.aggregate_id)
        if tracking is None:
            return False
        await self.store.append([NewEvent("node", envelope.aggregate_id, NodeRecovered(node_name="n"))],
                                expected_versions={("node", envelope.aggregate_id): 0}, tracking=tracking)
        return True
