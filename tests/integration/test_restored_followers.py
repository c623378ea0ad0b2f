"""A service started from a saved state (`EventSourcedService.restore`) follows its upstreams after what the state
holds of them, and answers their messages as a start that folds everything would: once each, also those the
upstream's relay published again."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest
import pytest_asyncio
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobStopped, NodeRecovered
from libs.eventstore import EventStore, NewEvent
from libs.skeleton.eventsourced import EventSourcedService, Restored, Upstream, aggregate_of
from libs.skeleton.runtime import ServiceRuntime
from tests.support.stores import StoreFactory
from tests.support.upstream import followed

pytestmark = pytest.mark.asyncio(loop_scope="session")

FOLLOWED = subjects.events_of_service("scheduler")


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    return await make_store("launcher")


@dataclass
class Saved:
    """A state saved with where it stands: the own log's position and the stream sequence of the upstream."""

    stops: dict[str, int]
    answered: dict[str, int]
    own_after: int
    events: int
    upstream_after: dict[str, int]


class Counting(EventSourcedService):
    """Counts each job's stops (a fold of the upstream) and answers each stop with `node/<job>-<n>`, n its answers
    for the job so far: a stop folded twice is counted twice, and answered twice."""

    name = "launcher"

    def __init__(self, runtime: ServiceRuntime, saved: Saved | None = None) -> None:
        super().__init__(runtime)
        self.saved = saved
        self.stops: dict[str, int] = {}
        self.answered: dict[str, int] = {}

    async def restore(self) -> Restored:
        if self.saved is None:
            return Restored()
        self.stops, self.answered = dict(self.saved.stops), dict(self.saved.answered)
        return Restored(own_after=self.saved.own_after, events=self.saved.events,
                        upstream_after=self.saved.upstream_after)

    def fold(self, envelope: EventEnvelope) -> None:
        job = envelope.aggregate_id.rsplit("-", 1)[0]
        self.answered[job] = self.answered.get(job, 0) + 1

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream=subjects.EVENTS_STREAM, subject=FOLLOWED, consumer="scheduler-events",
                         message_type=EventEnvelope, fold=self.count, react=self.answer, key=aggregate_of)]

    def count(self, envelope: EventEnvelope) -> None:
        self.stops[envelope.aggregate_id] = self.stops.get(envelope.aggregate_id, 0) + 1

    def answer(self, envelope: EventEnvelope) -> list[NewEvent]:
        name = f"{envelope.aggregate_id}-{self.answered.get(envelope.aggregate_id, 0)}"
        return [NewEvent("node", name, NodeRecovered(node_name=name))]

    def saved_state(self, own_after: int, upstream_after: dict[str, int]) -> Saved:
        """The state as it stands, having folded the own log up to `own_after` and the upstream up to `upstream_after`
        (every answer is one event of the own log)."""
        return Saved(stops=copy.copy(self.stops), answered=copy.copy(self.answered), own_after=own_after,
                     events=sum(self.answered.values()), upstream_after=upstream_after)


async def run(nc: Client, store: EventStore, tracked: int, saved: Saved | None = None) -> Counting:
    """The service started (from `saved`, if given) until its follower has handled the stream up to `tracked`."""
    service = Counting(cast(ServiceRuntime, SimpleNamespace(js=nc.jetstream(), store=store)), saved)
    return await followed(service, store, tracked, settle=0.3)


def stopped(job_id: str, position: int) -> EventEnvelope:
    return EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job", aggregate_id=job_id,
                         version=1, position=position, recorded_at=datetime.now(UTC),
                         event=JobStopped(job_id=job_id, by="bob"))


async def publish(nc: Client, envelopes: Sequence[EventEnvelope]) -> int:
    """Published as the upstream's relay does; the stream sequence of the last."""
    sequence = 0
    for envelope in envelopes:
        ack = await nc.jetstream().publish(subjects.event_subject("scheduler", "job",
                                                                  "JobStopped"), encode(envelope))
        sequence = ack.seq
    return sequence


async def answers(store: EventStore) -> list[str]:
    return [envelope.aggregate_id async for envelope in store.read_all()]


async def test_a_start_from_a_saved_state_counts_and_answers_a_stop_the_relay_published_again_once(
        nc: Client, store: EventStore) -> None:
    """The upstream's relay, down past JetStream's duplicate window, publishes again stops the saved state holds,
    while the service is down: started from that state, it counts and answers each stop once, as a start that
    folds the stream from its first message does."""
    history = [stopped(f"j{i}", i + 1) for i in range(5)]
    held = await publish(nc, history)
    first = await run(nc, store, tracked=held)
    saved = first.saved_state(await store.last_position(), {FOLLOWED: held})

    last = await publish(nc, [*history[3:], stopped("j5", 6)])  # from position 4 again, then a new stop
    restored = await run(nc, store, tracked=last, saved=saved)

    assert await answers(store) == [f"j{i}-0" for i in range(6)]  # no stop answered twice
    every_job_once = {f"j{i}": 1 for i in range(6)}
    assert restored.stops == every_job_once

    rebuilt = await run(nc, store, tracked=last)  # the same log and stream, folded from their first events
    assert rebuilt.stops == every_job_once
    assert rebuilt.answered == restored.answered
