"""Bundles of events (one message holding the events of one kind of aggregate that one append recorded) read by a
follower, by the check of a recorded position and by a job's history, against a real JetStream and PostgreSQL: each
event of a bundle counts as if it had come alone."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import pytest_asyncio
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, NodeRecovered, UpstreamMessageSetAside
from libs.eventstore import EventStore, Tracking
from libs.messaging.follower import StreamFollower, handled_through, still_holds
from libs.messaging.history import stored_events
from tests.support.reactor import Reactor
from tests.support.stores import StoreFactory
from tests.support.upstream import publish_bundle, stopped_envelope

pytestmark = pytest.mark.asyncio(loop_scope="session")
CONSUMER = "scheduler-events"


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    return await make_store("launcher")


async def follow(nc: Client, store: EventStore, reactor: Reactor, expected: int) -> StreamFollower:
    follower = StreamFollower(nc.jetstream(), store, stream=subjects.EVENTS_STREAM,
                              subject=subjects.events_of_service("scheduler"), consumer=CONSUMER,
                              message_type=EventEnvelope, handle=reactor.handle, retry_seconds=0.01)
    await follower.start()
    with contextlib.suppress(TimeoutError):  # the test's assertions say what did not come
        async with asyncio.timeout(60):
            while len(reactor.folded) < expected:
                await asyncio.sleep(0.02)
    return follower


async def answered(store: EventStore) -> list[str]:
    return [e.aggregate_id async for e in store.read_all() if isinstance(e.event, NodeRecovered)]


async def set_aside(store: EventStore) -> list[UpstreamMessageSetAside]:
    return [e.event async for e in store.read_all() if isinstance(e.event, UpstreamMessageSetAside)]


async def test_each_event_of_a_bundle_is_answered_once_though_the_service_stopped_in_its_middle(
        nc: Client, store: EventStore) -> None:
    """A service that had answered the first two events of a bundle when it stopped folds all of them when it starts
    again and answers the other three, each once; started once more, it answers none again."""
    bundle = [stopped_envelope(f"b{i}", i + 1) for i in range(5)]
    sequence = await publish_bundle(nc, bundle)
    await store.record_tracking(Tracking(CONSUMER, sequence, bundle[1].position))  # what it recorded before stopping

    first = Reactor(store)
    await (await follow(nc, store, first, expected=5)).stop()
    second = Reactor(store)
    await (await follow(nc, store, second, expected=5)).stop()

    assert first.folded == second.folded == [f"b{i}" for i in range(5)]
    assert await answered(store) == ["b2", "b3", "b4"]
    assert await store.tracked(CONSUMER) == (sequence, bundle[-1].position)


async def test_a_bundle_counts_as_handled_only_once_its_last_event_is(nc: Client, store: EventStore) -> None:
    """What a follower tells as handled whole (what a snapshot of the state would say it holds) stays before a bundle
    until every event of it is folded and answered: a state saved meanwhile would fold the bundle's first events
    again when restored."""
    before = await publish_bundle(nc, [stopped_envelope("a0", 1), stopped_envelope("a1", 2)])
    bundle = await publish_bundle(nc, [stopped_envelope(f"c{i}", i + 3) for i in range(3)])
    reactor = Reactor(store, hold="c2")
    follower = await follow(nc, store, reactor, expected=4)
    try:
        assert reactor.folded == ["a0", "a1", "c0", "c1"]
        assert follower.through == before
        assert set(follower.positions().values()) == {before}
        reactor.go_on.set()
        async with asyncio.timeout(30):
            while follower.through < bundle:
                await asyncio.sleep(0.02)
        assert reactor.folded[-1] == "c2"
    finally:
        await follower.stop()


async def test_an_event_of_a_bundle_that_cannot_be_read_is_set_aside_alone(nc: Client, store: EventStore) -> None:
    """A newer writer's event, or one that belongs to another kind of aggregate than its bundle's, is set aside on
    its own (the record names it), and the rest of its bundle is folded and answered; started again, the follower
    records nothing twice."""
    stranger = encode(EventEnvelope(event_id="e-node", service="scheduler", aggregate_type="node", aggregate_id="n9",
                                    version=1, position=3, recorded_at=stopped_envelope("x", 1).recorded_at,
                                    event=NodeRecovered(node_name="n9")))
    sequence = await publish_bundle(nc, [stopped_envelope("d0", 1), b'{"event_id": "e", "type": "JobTeleported.v1",'
                                         b' "position": 2}', stranger, stopped_envelope("d3", 4)])
    for _ in range(2):
        await (await follow(nc, store, Reactor(store), expected=2)).stop()

    assert await answered(store) == ["d0", "d3"]
    records = await set_aside(store)
    assert [(r.sequence, r.part, r.cause) for r in records] == [(sequence, 1, "undecodable"),
                                                               (sequence, 2, "inconsistent")]
    assert all(r.subject == subjects.bundle_subject("scheduler", "job") for r in records)


async def test_a_bundle_that_is_not_an_array_of_events_is_set_aside_whole_and_the_follower_goes_on(
        nc: Client, store: EventStore) -> None:
    for body in (b'{"not": "an array"}', b"[]"):
        await nc.jetstream().publish(subjects.bundle_subject("scheduler", "job"), body)
    await publish_bundle(nc, [stopped_envelope("e0", 1), stopped_envelope("e1", 2)])
    reactor = Reactor(store)
    await (await follow(nc, store, reactor, expected=2)).stop()

    assert reactor.folded == ["e0", "e1"] and await answered(store) == ["e0", "e1"]
    assert [(r.sequence, r.part, r.cause) for r in await set_aside(store)] == [(1, None, "undecodable"),
                                                                              (2, None, "undecodable")]


async def test_a_recorded_position_inside_a_bundle_is_known_to_be_still_in_the_stream_and_handled_in_part(
        nc: Client) -> None:
    """A start that restores a snapshot (which folds bundles whole) may take one only up to the last message its
    followers handled whole: a bundle answered in part is not."""
    sequence = await publish_bundle(nc, [stopped_envelope("f0", 7), stopped_envelope("f1", 8)])
    js, stream = nc.jetstream(), subjects.EVENTS_STREAM
    assert await still_holds(js, stream, sequence, 7) and await still_holds(js, stream, sequence, 8)
    assert not await still_holds(js, stream, sequence, 9)  # another log's bundle there now
    assert await handled_through(js, stream, sequence, 8) == sequence
    assert await handled_through(js, stream, sequence, 7) == sequence - 1
    assert await handled_through(js, stream, sequence, 9) is None
    assert await handled_through(js, stream, sequence + 1, 8) is None  # a stream younger than the tracking


async def test_a_jobs_history_reads_its_events_out_of_the_bundles_they_were_published_in(nc: Client) -> None:
    first = await publish_bundle(nc, [stopped_envelope("g1", 1), stopped_envelope("g2", 2), stopped_envelope("g1", 3)])
    later = await publish_bundle(nc, [stopped_envelope("g2", 4), stopped_envelope("g1", 5)])

    history = await stored_events(nc.jetstream(), [first, later], "g1")
    assert [e.position for e in history] == [1, 3, 5]
