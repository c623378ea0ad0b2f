"""The event store and its outbox relay against a real PostgreSQL and a real JetStream."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, PubAck

from libs.contracts import subjects
from libs.contracts.bundles import BUNDLE_EVENTS, stored_envelopes
from libs.contracts.codec import decode, encode
from libs.contracts.events import EventEnvelope, JobDeleted, JobStopped, JobSubmitted, NodeRecovered
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.eventstore import AlreadyProcessed, ConcurrencyConflict, EventStore, NewEvent, OutboxRelay, Tracking
from libs.eventstore import relay as relay_module
from libs.eventstore.relay import PublishUnacknowledged
from libs.messaging.connection import ensure_streams
from libs.messaging.reader import read_subject
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    return await make_store("scheduler")


def stopped(job_id: str) -> NewEvent:
    return NewEvent("job", job_id, JobStopped(job_id=job_id, by="alice"))


async def published(nc: Client) -> list[EventEnvelope]:
    """Every event in the events stream, in stream order (a bundle's one by one)."""
    js = nc.jetstream()
    info = await js.stream_info(subjects.EVENTS_STREAM)
    if not info.state.messages:
        return []
    sub = await js.subscribe(subjects.EVENTS_ALL, stream=subjects.EVENTS_STREAM, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL)
    envelopes = []
    for _ in range(info.state.messages):
        msg = await sub.next_msg(timeout=30)  # stored: delivered at once
        envelopes.extend(stored_envelopes(msg.subject, msg.data))
    await sub.unsubscribe()
    return envelopes


async def test_append_assigns_versions_and_reads_back(store: EventStore) -> None:
    first = await store.append([stopped("job-a"), NewEvent("job", "job-a", JobDeleted(job_id="job-a", by="alice"))],
                               expected_versions={("job", "job-a"): 0})
    assert [e.version for e in first] == [1, 2]
    assert first[0].position < first[1].position
    events = await store.read_aggregate("job", "job-a")
    assert [type(e.event) for e in events] == [JobStopped, JobDeleted]
    assert [e.event_id for e in events] == [e.event_id for e in first]


async def test_stale_version_is_a_conflict_and_writes_nothing(store: EventStore) -> None:
    await store.append([stopped("job-b")], expected_versions={("job", "job-b"): 0})
    with pytest.raises(ConcurrencyConflict):
        # Two events, the second on an aggregate whose version moved on: the whole append fails.
        await store.append([stopped("job-c"), stopped("job-b")],
                           expected_versions={("job", "job-c"): 0, ("job", "job-b"): 0})
    assert await store.read_aggregate("job", "job-c") == []
    assert len(await store.read_aggregate("job", "job-b")) == 1


async def test_tracking_makes_a_reaction_happen_once(store: EventStore) -> None:
    await store.append([stopped("job-d")], expected_versions={("job", "job-d"): 0},
                       tracking=Tracking("launcher-events", 7))
    with pytest.raises(AlreadyProcessed):
        await store.append([NewEvent("job", "job-d", JobDeleted(job_id="job-d", by="x"))],
                           expected_versions={("job", "job-d"): 1}, tracking=Tracking("launcher-events", 7))
    assert len(await store.read_aggregate("job", "job-d")) == 1
    assert await store.tracked_position("launcher-events") == 7
    assert await store.tracked_position("other-consumer") == 0


async def test_rebuild_reads_every_event_in_position_order(store: EventStore) -> None:
    for i in range(30):
        await store.append([NewEvent("node", f"n{i}", NodeRecovered(node_name=f"n{i}"))],
                           expected_versions={("node", f"n{i}"): 0})
    positions = [e.position async for e in store.read_all(batch=7)]
    assert len(positions) == 30
    assert positions == sorted(positions)


async def test_events_of_one_type_are_read_page_by_page_after_a_position(store: EventStore) -> None:
    for job_id in ("job-p", "job-q", "job-r"):
        await store.append([stopped(job_id), NewEvent("job", job_id, JobDeleted(job_id=job_id, by="alice"))],
                           expected_versions={("job", job_id): 0})
    await store.append([NewEvent("node", "job-s", JobStopped(job_id="job-s", by="alice"))],
                       expected_versions={("node", "job-s"): 0})  # same type, other kind of aggregate
    first = await store.read_type("job", JobStopped, limit=2)
    assert [(e.aggregate_id, type(e.event)) for e in first] == [("job-p", JobStopped), ("job-q", JobStopped)]
    rest = await store.read_type("job", JobStopped, after=first[-1].position, limit=2)
    assert [e.aggregate_id for e in rest] == ["job-r"]
    assert await store.read_type("job", JobStopped, after=rest[-1].position) == []


async def test_concurrent_appends_are_all_published_once_in_order(store: EventStore, nc: Client) -> None:
    """The relay tails by position while 40 writers append: none is skipped, none duplicated.

    One append is made slow between taking its position and committing (a trigger sleeps), the
    moment in which later positions could commit first and be published past it.
    """
    await store.pool.execute("""
        CREATE FUNCTION scheduler.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.aggregate_id = 'job-slow' THEN PERFORM pg_sleep(0.5); END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER slow_commit AFTER INSERT ON scheduler.events
            FOR EACH ROW EXECUTE FUNCTION scheduler.slow_commit();
    """)
    relay = OutboxRelay(store, nc.jetstream(), poll_seconds=0.05)
    relay_task = asyncio.create_task(relay.run())

    async def writer(w: int) -> None:
        for i in range(10):
            job_id = f"job-w{w}-{i}"
            await store.append([stopped(job_id)], expected_versions={("job", job_id): 0})

    slow = asyncio.create_task(store.append([stopped("job-slow")], expected_versions={("job", "job-slow"): 0}))
    await asyncio.sleep(0.1)
    await asyncio.gather(slow, *(writer(w) for w in range(40)))
    last = await store.last_position()
    with contextlib.suppress(TimeoutError):  # the assertions below say what it did not publish
        async with asyncio.timeout(60):
            while relay.published_position < last:
                await asyncio.sleep(0.05)
    relay_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await relay_task
    # A relay that stopped wrote where it got to: the next one does not publish it all again.
    assert await store.pool.fetchval("SELECT published_position FROM scheduler.relay") == last

    envelopes = await published(nc)
    assert len(envelopes) == 401
    assert len({e.event_id for e in envelopes}) == 401
    assert [e.position for e in envelopes] == sorted(e.position for e in envelopes)


async def test_relay_restart_republishes_without_duplicates(store: EventStore, nc: Client) -> None:
    """A relay that crashed after publishing but before saving its position publishes again;
    JetStream drops the repeats by message id."""
    for i in range(5):
        await store.append([stopped(f"job-r{i}")], expected_versions={("job", f"job-r{i}"): 0})
    assert await OutboxRelay(store, nc.jetstream()).publish_pending() == 5
    await store.pool.execute("UPDATE scheduler.relay SET published_position = 0")
    assert await OutboxRelay(store, nc.jetstream()).publish_pending() == 5  # the relay after the crash
    envelopes = await published(nc)
    assert len(envelopes) == 5
    subjects_seen = {type(e.event).name() for e in envelopes}
    assert subjects_seen == {"JobStopped"}


async def test_published_events_are_what_the_log_holds_on_their_own_subjects(store: EventStore, nc: Client) -> None:
    """Followers get each event, its trace and its place in the log as the service recorded them: alone on the
    subject named for its service, aggregate and type, its trace in the message's headers too; or, the events of one
    kind of aggregate one append recorded, together in a bundle on that kind's bundle subject."""
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    spec = JobSpec(name="ünïcode \"quoted\" name", flavors=["cpu-1"], algorithm=AlgorithmRef(name="pytorch-ddp"),
                   command="python train.py --lr 0.001", env={"EMOJI": "🚀", "EMPTY": ""}, output=OutputRef(name="out"))
    await store.append([NewEvent("job", "job-p0", JobSubmitted(job_id="job-p0", spec=spec, creator="alice"),
                                 trace=trace)], expected_versions={("job", "job-p0"): 0})
    events = [NewEvent("job", "job-p1", JobSubmitted(job_id="job-p1", spec=spec, creator="alice"), trace=trace),
              stopped("job-p1"), NewEvent("node", "node-a", NodeRecovered(node_name="node-a")), stopped("job-p2")]
    await store.append(events, expected_versions={("job", "job-p1"): 0, ("node", "node-a"): 0, ("job", "job-p2"): 0})
    assert await OutboxRelay(store, nc.jetstream()).publish_pending() == 5
    logged = [envelope async for envelope in store.read_all()]
    messages = [m async for m in read_subject(nc.jetstream(), subjects.EVENTS_STREAM, subjects.EVENTS_ALL)]
    assert [m.subject for m in messages] == [
        "trainyard.events.scheduler.job.JobSubmitted", "trainyard.events.scheduler.job.bundle",
        "trainyard.events.scheduler.node.NodeRecovered", "trainyard.events.scheduler.job.JobStopped"]
    assert [stored_envelopes(m.subject, m.data) for m in messages] == [logged[:1], logged[1:3], [logged[3]],
                                                                        [logged[4]]]
    assert messages[0].headers is not None and messages[0].headers["traceparent"] == trace["traceparent"]
    assert decode(messages[0].data, EventEnvelope).trace == trace
    assert stored_envelopes(messages[1].subject, messages[1].data)[0].trace == trace


async def test_an_event_whose_stored_text_is_too_roomy_is_published_compact(store: EventStore, nc: Client,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL keeps an event's JSON with a space after every comma and colon: an event the append kept within
    the limit as it encodes it must not go over it as published, so one that would is encoded again."""
    await store.append([stopped("job-big")], expected_versions={("job", "job-big"): 0})
    (row,) = await store.pool.fetch("SELECT * FROM scheduler.events WHERE aggregate_id = 'job-big'")
    roomy = relay_module.outgoing(store, [row]).data
    assert b'", "' in roomy  # the stored text, spliced in
    monkeypatch.setattr(relay_module, "MAX_EVENT_BYTES", len(roomy) - 1)
    assert await OutboxRelay(store, nc.jetstream()).publish_pending() == 1
    (message,) = [m async for m in read_subject(nc.jetstream(), subjects.EVENTS_STREAM, subjects.EVENTS_ALL)]
    assert message.data == encode(store.envelope(row)) and len(message.data) < len(roomy)


class BrokenAfter:
    """JetStream through a connection that breaks after `sent` publishes: the later ones never arrive."""

    def __init__(self, js: JetStreamContext, sent: int) -> None:
        self.js = js
        self.sent = sent

    async def publish_async(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future[PubAck]:
        if self.sent > 0:
            self.sent -= 1
            return await self.js.publish_async(subject, payload, headers=headers)
        return asyncio.get_running_loop().create_future()  # its acknowledgement never comes


async def test_a_relay_that_lost_its_connection_midway_publishes_the_rest_in_order(store: EventStore,
                                                                                   nc: Client) -> None:
    """Only the first events of a run reached JetStream: the relay's position stops at the last of them, and
    the rest is published after them, once each."""
    for i in range(6):
        await store.append([stopped(f"job-m{i}")], expected_versions={("job", f"job-m{i}"): 0})
    relay = OutboxRelay(store, BrokenAfter(nc.jetstream(), 2), ack_seconds=0.2)  # type: ignore[arg-type]
    with pytest.raises(PublishUnacknowledged):
        await relay.publish_pending()
    assert relay.published_position == (await store.read_aggregate("job", "job-m1"))[0].position
    assert [e.aggregate_id for e in await published(nc)] == ["job-m0", "job-m1"]

    relay.js = nc.jetstream()  # connected again
    assert await relay.publish_pending() == 4
    assert [e.aggregate_id for e in await published(nc)] == [f"job-m{i}" for i in range(6)]


class Watched:
    """JetStream, noting how many times the event loop had turned at each publish."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.turns = 0
        self.seen: list[int] = []

    async def turning(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    async def publish_async(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future[PubAck]:
        self.seen.append(self.turns)
        return await self.js.publish_async(subject, payload, headers=headers)


async def test_a_relay_hands_a_run_to_the_connection_without_a_pause(store: EventStore, nc: Client) -> None:
    """The stream keeps the log's order because a run leaves whole on one connection: nothing else runs while
    the relay hands it over, so no reconnect can come between two of its events."""
    watched = Watched(nc.jetstream())
    relay = OutboxRelay(store, watched)  # type: ignore[arg-type]
    await store.append([stopped("job-p0")], expected_versions={("job", "job-p0"): 0})
    assert await relay.publish_pending() == 1
    for i in range(1, 51):
        await store.append([stopped(f"job-p{i}")], expected_versions={("job", f"job-p{i}"): 0})
    turning = asyncio.create_task(watched.turning())
    try:
        watched.seen.clear()
        assert await relay.publish_pending() == 50
    finally:
        turning.cancel()
    assert len(watched.seen) == 50 and len(set(watched.seen)) == 1


async def test_a_relay_publishes_its_events_again_after_the_stream_lost_them(store: EventStore, nc: Client) -> None:
    """The events stream deleted and made anew (a lost JetStream store): the relay sees it no longer has
    the service's newest event and publishes the whole log again, so a follower rebuilds everything."""
    for i in range(5):
        await store.append([stopped(f"job-h{i}")], expected_versions={("job", f"job-h{i}"): 0})
    relay = OutboxRelay(store, nc.jetstream())
    assert await relay.publish_pending() == 5
    assert await relay.rewind_if_history_lost() == 5  # the stream has them: nothing to do

    js = nc.jetstream()
    await js.delete_stream(subjects.EVENTS_STREAM)
    await ensure_streams(js)
    assert await relay.rewind_if_history_lost() == 0
    assert await relay.publish_pending() == 5
    assert [e.aggregate_id for e in await published(nc)] == [f"job-h{i}" for i in range(5)]


class SlowToTakeBack:
    """A pool that does not end taking back what is handed back to it by hand (as `pool.release(conn)`; what it
    lends and takes back itself, for `pool.fetch` and the like, goes as it would), as a reset that does not end."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.never = asyncio.Event()
        self.handed_back: list[int] = []  # the server processes of the connections handed back

    def __getattr__(self, name: str) -> object:
        return getattr(self.pool, name)

    async def release(self, connection: asyncpg.pool.PoolConnectionProxy, *, timeout: float | None = None) -> None:
        self.handed_back.append(connection.get_server_pid())
        await asyncio.shield(self.never.wait())


async def test_a_relay_stops_in_time_when_its_connection_is_slow_to_go_back_to_the_pool(
        store: EventStore, nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncpg gives a connection back shielded from cancellation, for as long as resetting it takes: a relay's
    stop does not wait for that; it closes the connection, and the pool serves on."""
    relay = OutboxRelay(store, nc.jetstream(), poll_seconds=0.05)
    running = asyncio.create_task(relay.run())
    await store.append([stopped("job-let-go")], expected_versions={("job", "job-let-go"): 0})
    while relay.published_position < await store.last_position():
        await asyncio.sleep(0.05)
    slow = SlowToTakeBack(store.pool)
    monkeypatch.setattr(relay_module, "LET_GO_SECONDS", 0.5)
    monkeypatch.setattr(store, "pool", slow)
    running.cancel()
    done, _ = await asyncio.wait({running}, timeout=10)
    monkeypatch.undo()
    slow.never.set()
    assert done, "the relay's stop waited for its connection"
    [backend] = slow.handed_back

    async def server_process_gone() -> bool:  # closed rather than waited for: its server process ends
        return not await store.pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend)

    await eventually(server_process_gone, timeout=2.5)
    assert await store.pool.fetchval("SELECT published_position FROM scheduler.relay") == relay.published_position
    assert await store.pool.fetchval("SELECT 1") == 1  # the pool has its connection back, closed


async def test_a_relay_publishes_what_one_append_recorded_in_bundles_of_a_bounded_size(store: EventStore,
                                                                                        nc: Client) -> None:
    """An append's events of one kind of aggregate go in as few messages as the bundle's bounds allow, each with an id
    of its own, so that publishing the same rows again is dropped; the relay's history check reads the newest event
    inside a bundle."""
    count = BUNDLE_EVENTS + 6
    await store.append([stopped(f"job-b{i}") for i in range(count)],
                       expected_versions={("job", f"job-b{i}"): 0 for i in range(count)})
    relay = OutboxRelay(store, nc.jetstream())
    assert await relay.publish_pending() == count
    messages = [m async for m in read_subject(nc.jetstream(), subjects.EVENTS_STREAM, subjects.EVENTS_ALL)]
    assert [len(stored_envelopes(m.subject, m.data)) for m in messages] == [BUNDLE_EVENTS, 6]
    assert [e.aggregate_id for e in await published(nc)] == [f"job-b{i}" for i in range(count)]
    assert await relay.rewind_if_history_lost() == await store.last_position()  # the stream has the newest

    await store.pool.execute("UPDATE scheduler.relay SET published_position = 0")
    assert await OutboxRelay(store, nc.jetstream()).publish_pending() == count  # a relay after a crash
    assert len(await published(nc)) == count  # JetStream dropped the repeats
