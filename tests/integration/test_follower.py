"""StreamFollower: replays a stream on every start and reacts exactly once per message."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobStopped, NodeRecovered
from libs.eventstore import EventStore, NewEvent, Tracking
from libs.messaging import follower as follower_module
from libs.messaging.connection import ensure_streams
from libs.messaging.follower import StreamFollower
from tests.support.stores import StoreFactory
from tests.support.upstream import publish_upstream

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    return await make_store("launcher")




class Recorder:
    """Folds every message; reacts by appending one event per message, with its tracking."""

    def __init__(self, store: EventStore, fail_first: str | None = None) -> None:
        self.store = store
        self.folded: list[str] = []
        self.fail_first = fail_first

    async def handle(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        job_id = envelope.aggregate_id
        if job_id == self.fail_first:
            self.fail_first = None
            raise RuntimeError("a passing failure")
        self.folded.append(job_id)
        if tracking is None:
            return False
        await self.store.append([NewEvent("node", job_id, NodeRecovered(node_name=job_id))],
                                expected_versions={("node", job_id): 0}, tracking=tracking)
        return True


def held_back(recorder: Recorder) -> tuple[asyncio.Event, Callable[[EventEnvelope, Msg, Tracking | None],
                                                                     Awaitable[bool]]]:
    """A handler that waits until the event is set, then records as `recorder` does."""
    go_on = asyncio.Event()

    async def handle(envelope: EventEnvelope, msg: Msg, tracking: Tracking | None) -> bool:
        await go_on.wait()
        return await recorder.handle(envelope, msg, tracking)

    return go_on, handle


async def follow(nc: Client, store: EventStore, recorder: Recorder, expected: int,
                 subject: str | tuple[str, ...] = subjects.events_of_service("scheduler"),
                 folded: dict[str, int] | None = None) -> StreamFollower:
    follower = StreamFollower(nc.jetstream(), store, stream=subjects.EVENTS_STREAM,
                              subject=subject, consumer="scheduler-events",
                              message_type=EventEnvelope, handle=recorder.handle, retry_seconds=0.01, folded=folded)
    await follower.start()
    await asyncio.wait_for(follower.caught_up.wait(), 60)
    with contextlib.suppress(TimeoutError):  # the test's assertions say what did not come
        async with asyncio.timeout(60):
            while len(recorder.folded) < expected:
                await asyncio.sleep(0.05)
    return follower


async def test_restart_replays_everything_and_reacts_only_to_new_messages(nc: Client, store: EventStore) -> None:
    await publish_upstream(nc, [f"a{i}" for i in range(5)])
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=5)
    await follower.stop()
    assert first.folded == [f"a{i}" for i in range(5)]

    await publish_upstream(nc, [f"b{i}" for i in range(3)])
    second = Recorder(store)
    follower = await follow(nc, store, second, expected=8)
    await follower.stop()

    # The view is rebuilt from the first message; reactions happened once per message in all.
    assert second.folded == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]
    reacted = [e.aggregate_id async for e in store.read_all()]
    assert reacted == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]


async def test_a_failing_handler_is_retried_not_skipped(nc: Client, store: EventStore) -> None:
    await publish_upstream(nc, ["x0", "x1", "x2"])
    recorder = Recorder(store, fail_first="x1")
    follower = await follow(nc, store, recorder, expected=3)
    await follower.stop()
    assert recorder.folded == ["x0", "x1", "x2"]
    assert [e.aggregate_id async for e in store.read_all()] == ["x0", "x1", "x2"]


async def test_an_empty_stream_counts_as_caught_up(nc: Client, store: EventStore) -> None:
    recorder = Recorder(store)
    follower = await follow(nc, store, recorder, expected=0)
    await follower.stop()
    assert recorder.folded == []


async def test_a_stream_with_only_other_subjects_counts_as_caught_up(nc: Client, store: EventStore) -> None:
    """Other services' messages fill the stream, none match the filter: the view is complete."""
    for i in range(3):
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="node",
                                 aggregate_id=f"n{i}", version=1, position=i + 1, recorded_at=datetime.now(UTC),
                                 event=NodeRecovered(node_name=f"n{i}"))
        await nc.jetstream().publish(subjects.event_subject("monitor", "node", "NodeRecovered"),
                                     encode(envelope))
    recorder = Recorder(store)
    follower = await follow(nc, store, recorder, expected=0)
    await follower.stop()
    assert recorder.folded == []


async def test_a_follower_catching_up_holds_one_batch_of_the_backlog_not_all_of_it(
        nc: Client, nats_url: str, store: EventStore) -> None:
    """A service started after a long stretch of its upstream's log is handed it a batch at a time, the next fetched
    while one is handled: the backlog never waits whole in its memory (it stayed there after a restart)."""
    backlog = 8 * follower_module.CATCH_UP_BATCH
    await publish_upstream(nc, [f"w{i}" for i in range(backlog)])
    recorder = Recorder(store)
    go_on, slow = held_back(recorder)
    own = await nats.connect(nats_url)  # its messages counted alone
    follower = StreamFollower(own.jetstream(), store, stream=subjects.EVENTS_STREAM,
                              subject=subjects.events_of_service("scheduler"), consumer="scheduler-events",
                              message_type=EventEnvelope, handle=slow, retry_seconds=0.01)
    try:
        await follower.start()
        await asyncio.sleep(1.0)  # what the server would push meanwhile
        assert own.stats["in_msgs"] <= 2 * follower_module.CATCH_UP_BATCH + 16
        assert await follower.lag() >= backlog - 2 * follower_module.CATCH_UP_BATCH
        go_on.set()
        await asyncio.wait_for(follower.caught_up.wait(), 60)
        assert recorder.folded[-backlog:] == [f"w{i}" for i in range(backlog)]
        await publish_upstream(nc, ["after"])  # then followed as it comes
        async with asyncio.timeout(30):
            while recorder.folded[-1] != "after":
                await asyncio.sleep(0.05)
    finally:
        await follower.stop()
        await own.close()


async def test_a_follower_whose_consumer_vanished_while_catching_up_reads_on_from_where_it_was(
        nc: Client, store: EventStore) -> None:
    """A NATS server started again has lost the ephemeral consumers: the follower makes its own anew and neither
    skips nor repeats a message."""
    backlog = 4 * follower_module.CATCH_UP_BATCH
    await publish_upstream(nc, [f"v{i}" for i in range(backlog)])
    recorder = Recorder(store)
    go_on, slow = held_back(recorder)
    follower = StreamFollower(nc.jetstream(), store, stream=subjects.EVENTS_STREAM,
                              subject=subjects.events_of_service("scheduler"), consumer="scheduler-events",
                              message_type=EventEnvelope, handle=slow, retry_seconds=0.01)
    try:
        await follower.start()
        await asyncio.sleep(0.3)
        for consumer in await nc.jetstream().consumers_info(subjects.EVENTS_STREAM):
            await nc.jetstream().delete_consumer(subjects.EVENTS_STREAM, consumer.name)
        go_on.set()
        await asyncio.wait_for(follower.caught_up.wait(), 60)
        assert recorder.folded == [f"v{i}" for i in range(backlog)]
    finally:
        await follower.stop()


async def test_a_message_of_an_unknown_type_is_passed_over(nc: Client, store: EventStore) -> None:
    """A newer writer's event type must not stall an older reader."""
    await publish_upstream(nc, ["y0"])
    await nc.jetstream().publish(subjects.event_subject("scheduler", "job", "JobTeleported"),
                                 b'{"event_id": "e", "type": "JobTeleported.v1"}')
    await publish_upstream(nc, ["y1"])
    recorder = Recorder(store)
    follower = await follow(nc, store, recorder, expected=2)
    await follower.stop()
    assert recorder.folded == ["y0", "y1"]
    assert await store.tracked_position("scheduler-events") == 3


async def test_an_envelope_the_relay_published_again_is_applied_once(nc: Client, store: EventStore) -> None:
    """After a crash past the duplicate window the relay publishes again what JetStream already holds:
    the follower knows the repeat by its position and event id, and passes over it, tracked."""
    envelopes = [EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job",
                               aggregate_id=job_id, version=1, position=position, recorded_at=datetime.now(UTC),
                               event=JobStopped(job_id=job_id, by="bob"))
                 for position, job_id in ((1, "a"), (2, "b"), (3, "c"))]
    for envelope in (envelopes[0], envelopes[1], envelopes[0], envelopes[1], envelopes[2]):
        await nc.jetstream().publish(subjects.event_subject("scheduler", "job", "JobStopped"),
                                     encode(envelope))
    recorder = Recorder(store)

    follower = await follow(nc, store, recorder, expected=3)
    await follower.stop()

    assert recorder.folded == ["a", "b", "c"]
    assert await store.tracked_position("scheduler-events") == 5


async def test_after_the_stream_was_made_anew_only_what_is_new_upstream_is_reacted_to(
        nc: Client, store: EventStore) -> None:
    """JetStream lost the stream; the upstream's relay publishes its whole log again, behind other
    services' messages: the stream sequences changed, the upstream positions did not."""
    history = [EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type="job",
                             aggregate_id=f"a{i}",
                             version=1, position=i + 1, recorded_at=datetime.now(UTC),
                             event=JobStopped(job_id=f"a{i}", by="bob")) for i in range(5)]
    new = msgspec.structs.replace(history[0], event_id=str(uuid.uuid4()), aggregate_id="b0", position=6,
                                  event=JobStopped(job_id="b0", by="bob"))

    async def publish(envelopes: list[EventEnvelope]) -> None:
        for envelope in envelopes:
            await nc.jetstream().publish(subjects.event_subject("scheduler", "job",
                                                                "JobStopped"), encode(envelope))

    await publish(history)
    follower = await follow(nc, store, Recorder(store), expected=5)
    await follower.stop()

    js = nc.jetstream()
    await js.delete_stream(subjects.EVENTS_STREAM)
    await ensure_streams(js)
    for i in range(3):  # another service's relay was first
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="node",
                                 aggregate_id=f"n{i}", version=1, position=i + 1, recorded_at=datetime.now(UTC),
                                 event=NodeRecovered(node_name=f"n{i}"))
        await js.publish(subjects.event_subject("monitor", "node", "NodeRecovered"), encode(envelope))
    await publish([*history, new])
    again = Recorder(store)
    follower = await follow(nc, store, again, expected=6)
    await follower.stop()

    assert again.folded == [f"a{i}" for i in range(5)] + ["b0"]  # the view is whole again
    assert [e.aggregate_id async for e in store.read_all()] == [f"a{i}" for i in range(5)] + ["b0"]  # each once


async def test_a_follower_naming_aggregates_gets_their_events_only_and_reacts_once_to_each(
        nc: Client, store: EventStore) -> None:
    """The scheduler's events about other aggregates are never delivered; replay and tracking work on what is."""
    kinds = ["job", "preload", "drain", "job", "storage", "job"]

    async def publish(first: int) -> None:
        for position, kind in enumerate(kinds, start=first):
            aggregate_id = f"{kind}-{position}"
            envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type=kind,
                                     aggregate_id=aggregate_id, version=1, position=position,
                                     recorded_at=datetime.now(UTC), event=JobStopped(job_id=aggregate_id, by="bob"))
            await nc.jetstream().publish(subjects.event_subject("scheduler", kind, "JobStopped"),
                                         encode(envelope))

    read = subjects.events_of("scheduler", "job", "drain")
    await publish(1)
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=4, subject=read)
    await follower.stop()
    assert first.folded == ["job-1", "drain-3", "job-4", "job-6"]

    await publish(7)
    again = Recorder(store)
    follower = await follow(nc, store, again, expected=8, subject=read)
    await follower.stop()
    assert again.folded == ["job-1", "drain-3", "job-4", "job-6", "job-7", "drain-9", "job-10", "job-12"]
    assert [e.aggregate_id async for e in store.read_all()] == again.folded  # each reacted to once


async def test_a_follower_of_a_restored_state_begins_after_what_it_holds_of_each_subject(
        nc: Client, store: EventStore) -> None:
    """Given, per subject filter, the stream position up to which a restored state holds its messages, a follower
    passes those over (neither folded nor reacted to) and folds and answers the rest, each once."""
    read = subjects.events_of("scheduler", "job", "drain")
    jobs, drains = read

    async def publish(kind: str, number: int) -> int:
        aggregate_id = f"{kind}-{number}"
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type=kind,
                                 aggregate_id=aggregate_id, version=1, position=number,
                                 recorded_at=datetime.now(UTC), event=JobStopped(job_id=aggregate_id, by="bob"))
        ack = await nc.jetstream().publish(subjects.event_subject("scheduler", kind, "JobStopped"),
                                           encode(envelope))
        return ack.seq

    sequences = {number: await publish(kind, number)
                 for number, kind in enumerate(["job", "drain", "job", "drain", "job"], start=1)}
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=5, subject=read)
    await follower.stop()

    # The state holds the jobs' messages up to job-3 and the drains' up to drain-2; one more of each comes after.
    await publish("job", 6)
    await publish("drain", 7)
    restored = Recorder(store)
    follower = await follow(nc, store, restored, expected=4, subject=read,
                            folded={jobs: sequences[3], drains: sequences[2]})
    await follower.stop()
    assert restored.folded == ["drain-4", "job-5", "job-6", "drain-7"]
    assert [e.aggregate_id async for e in store.read_all()] == [
        "job-1", "drain-2", "job-3", "drain-4", "job-5", "job-6", "drain-7"]  # each answered once


async def test_a_follower_begins_part_way_only_on_filters_it_can_match(store: EventStore) -> None:
    with pytest.raises(ValueError, match="prefix"):
        StreamFollower(None, store, stream=subjects.EVENTS_STREAM,  # type: ignore[arg-type]
                       subject="trainyard.events.*.job.>", consumer="c", message_type=EventEnvelope,
                       handle=Recorder(store).handle, folded={"trainyard.events.*.job.>": 3})


def stopped(job_id: str, position: int, kind: str = "job") -> EventEnvelope:
    """A `JobStopped` of the scheduler's on `kind/<job_id>`, at `position` in its log."""
    return EventEnvelope(event_id=str(uuid.uuid4()), service="scheduler", aggregate_type=kind, aggregate_id=job_id,
                         version=1, position=position, recorded_at=datetime.now(UTC),
                         event=JobStopped(job_id=job_id, by="bob"))


async def publish_envelopes(nc: Client, envelopes: list[EventEnvelope]) -> list[int]:
    """Published as the relay does; their stream sequences."""
    acks = [await nc.jetstream().publish(subjects.event_subject("scheduler", envelope.aggregate_type, "JobStopped"),
                                         encode(envelope)) for envelope in envelopes]
    return [ack.seq for ack in acks]


async def publish_others(nc: Client, count: int) -> None:
    """Another service's events, which no follower of the scheduler's is delivered."""
    for i in range(count):
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="node",
                                 aggregate_id=f"n{i}", version=1, position=i + 1, recorded_at=datetime.now(UTC),
                                 event=NodeRecovered(node_name=f"n{i}"))
        await nc.jetstream().publish(subjects.event_subject("monitor", "node", "NodeRecovered"),
                                     encode(envelope))


async def test_a_follower_of_a_restored_state_knows_an_envelope_published_again_after_what_it_holds(
        nc: Client, store: EventStore) -> None:
    """The relay published again, past the duplicate window, envelopes a restored state holds already, while the
    service was down: the follower begins after what the state holds, and still passes over those copies as it does
    after a replay from the stream's first message, neither folding them twice nor reacting to them again."""
    history = [stopped(f"a{i}", i + 1) for i in range(5)]
    held = (await publish_envelopes(nc, history))[-1]
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=5)
    await follower.stop()

    await publish_envelopes(nc, [*history[3:], stopped("b5", 6)])  # from position 4 again, then a new one
    restored = Recorder(store)
    follower = await follow(nc, store, restored, expected=1, folded={subjects.events_of_service("scheduler"): held})
    await asyncio.sleep(0.3)  # a copy folded again would come within this
    await follower.stop()

    assert restored.folded == ["b5"]
    assert [e.aggregate_id async for e in store.read_all()] == [f"a{i}" for i in range(5)] + ["b5"]  # none set aside
    assert await store.tracked_position("scheduler-events") == 8

    replayed = Recorder(store)  # as a start without the restored state sees it
    follower = await follow(nc, store, replayed, expected=6)
    await follower.stop()
    assert replayed.folded == [f"a{i}" for i in range(5)] + ["b5"]


async def test_a_restored_follower_remembers_as_many_envelopes_as_a_replayed_one_however_far_back(
        nc: Client, store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """What it remembers of the messages before the restored state's position is the latest REMEMBERED_ENVELOPES
    of its filter, wherever they lie among other services' messages: a copy of the oldest of those is passed over,
    and one of an older envelope is not known, as after a replay."""
    monkeypatch.setattr(follower_module, "REMEMBERED_ENVELOPES", 4)
    history: list[EventEnvelope] = []
    for i in range(8):
        history.append(stopped(f"a{i}", i + 1))
        await publish_envelopes(nc, history[-1:])
        await publish_others(nc, 7)  # so that the filter's messages lie far apart in the stream
    held = (await nc.jetstream().stream_info(subjects.EVENTS_STREAM)).state.last_seq
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=8)
    await follower.stop()

    await publish_envelopes(nc, history[4:])  # the latest four again: all remembered
    noted: list[int] = []
    note = StreamFollower._held

    def counted(self: StreamFollower, msg: Msg) -> None:
        noted.append(msg.metadata.sequence.stream)
        note(self, msg)

    monkeypatch.setattr(StreamFollower, "_held", counted)
    restored = Recorder(store)
    follower = await follow(nc, store, restored, expected=0, folded={subjects.events_of_service("scheduler"): held})
    await asyncio.sleep(0.3)
    await follower.stop()
    assert restored.folded == []
    assert 4 <= len(noted) < 8  # not the whole stream

    await publish_envelopes(nc, history[3:4])  # older than what a replayed follower remembers at that point
    replayed, again = Recorder(store), Recorder(store)
    follower = await follow(nc, store, replayed, expected=9)
    await follower.stop()
    follower = await follow(nc, store, again, expected=1, folded={subjects.events_of_service("scheduler"): held})
    await asyncio.sleep(0.3)
    await follower.stop()
    assert replayed.folded == [f"a{i}" for i in range(8)] + ["a3"]
    assert again.folded == ["a3"]  # as the replay did


async def test_a_follower_restored_further_on_one_filter_knows_the_copies_of_what_that_filter_holds(
        nc: Client, store: EventStore) -> None:
    """The state holds the jobs' messages further than the drains': the jobs' messages in between are passed over
    unfolded, and still known when the relay publishes them again."""
    read = subjects.events_of("scheduler", "job", "drain")
    jobs, drains = read
    history = [stopped(f"{kind}-{number}", number, kind)
               for number, kind in enumerate(["job", "drain", "job", "drain", "job"], start=1)]
    sequences = await publish_envelopes(nc, history)
    first = Recorder(store)
    follower = await follow(nc, store, first, expected=5, subject=read)
    await follower.stop()

    await publish_envelopes(nc, [*history[2:], stopped("drain-6", 6, "drain"), stopped("job-7", 7)])
    restored = Recorder(store)
    follower = await follow(nc, store, restored, expected=3, subject=read,
                            folded={jobs: sequences[4], drains: sequences[1]})
    await asyncio.sleep(0.3)
    await follower.stop()
    assert restored.folded == ["drain-4", "drain-6", "job-7"]
    assert [e.aggregate_id async for e in store.read_all()] == [
        "job-1", "drain-2", "job-3", "drain-4", "job-5", "drain-6", "job-7"]  # each answered once
