"""The transactional outbox relay: publishes a store's events to JetStream, in order, once.

The event table is the outbox. The relay reads events past its published position, publishes each
with `Nats-Msg-Id` = the event id and moves the position on to the last event JetStream acknowledged,
all before it without a gap. The events of one kind of aggregate that one append recorded go as one message, a
bundle (`bundles`, `libs/contracts/bundles.py`): a message costs the relay, nats-server and each follower far more
than an event's bytes, and under load an append records the reactions to dozens of messages (2,000 trivial jobs:
18,000 events in some 1,400 messages). It publishes a run of messages at once and then waits for their
acknowledgements, rather than one round trip each, so that a burst costs a few wake-ups, not many.
After a crash it publishes again from the last recorded position; JetStream's duplicate window drops
the repeats (and followers pass over repeats it no longer remembers). A session advisory lock keeps
one relay active per store. Each message is made from its row without decoding the event: the row's JSON is
spliced into the envelope (about 2% of a trivial job's CPU across the services, docs/benchmarks.md).

JetStream may lose what it was given (the stream deleted and made anew, its store lost): at start,
and every HISTORY_CHECK_SECONDS, the relay looks at the newest of its service's events the stream
still has, and publishes again from there when that is behind what it recorded as published. So a
service that follows this one rebuilds the same view on its next start, whatever happened to NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import asyncpg
import msgspec
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NotFoundError

from libs.contracts.bundles import BUNDLE_BYTES, BUNDLE_EVENTS, stored_envelopes
from libs.contracts.codec import encode
from libs.contracts.events import Event, EventEnvelope
from libs.contracts.subjects import (
    EVENTS_STREAM,
    SET_ASIDE_AGGREGATE,
    bundle_subject,
    event_subject,
    events_of_service,
)
from libs.eventstore.store import ENVELOPE_BYTES, MAX_EVENT_BYTES, EventStore
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
HISTORY_CHECK_SECONDS = 30.0
LET_GO_SECONDS = 3.0  # what the relay's stop may take to give its connection back (`_let_go`)
# A run of events published before their acknowledgements are awaited: far within nats-py's buffers (2 MiB
# of pending data, 1024 flushes queued, 4000 acknowledgements awaited), so a run is never sent in parts.
RUN_EVENTS = 256
RUN_BYTES = 1024 * 1024
# How long the relay waits for JetStream to acknowledge anything more before it publishes again.
ACK_SECONDS = 5.0


# The name an event's subject ends with (`_Event.name`), by the tag its row keeps.
EVENT_NAMES = {member.__struct_config__.tag: member.name() for member in typing.get_args(Event)}


# An `EventEnvelope` as the relay publishes it from its row: the fields of the envelope, in its order (so that a
# follower decodes it as one), with the event and its trace as the JSON the row keeps, spliced in as they are rather
# than decoded and encoded again (the service's own events, checked when it recorded them).
_Published = msgspec.defstruct(
    "_Published", [(field.name, msgspec.Raw if field.name in ("event", "trace") else field.type)
                   for field in msgspec.structs.fields(EventEnvelope)], kw_only=True)


@dataclass(frozen=True)
class Outgoing:
    """One message ready to publish: a stored event, or a bundle of them (`subjects.bundle_subject`)."""

    position: int  # of its last event
    events: int
    subject: str
    headers: dict[str, str]
    data: bytes


def outgoing(store: EventStore, rows: Sequence[asyncpg.Record]) -> Outgoing:
    """The message that publishes the events of `rows`, one of `store`'s or a bundle of them (`bundles`)."""
    first, last = rows[0], rows[-1]
    if len(rows) == 1:
        trace: dict[str, str] = msgspec.json.decode(first["trace"], type=dict[str, str])
        subject = event_subject(store.service, first["aggregate_type"], EVENT_NAMES[first["type"]])
        return Outgoing(first["position"], 1, subject, {"Nats-Msg-Id": str(first["event_id"]), **trace},
                        _envelope(store, first))
    # Each envelope carries its trace: the message has none of its own. Its id is the same whenever the relay publishes
    # it again, as long as the same rows make it (a crash between reads of another size may cut a bundle elsewhere:
    # followers pass over the events they had, `libs/messaging/follower.py`).
    return Outgoing(last["position"], len(rows), bundle_subject(store.service, first["aggregate_type"]),
                    {"Nats-Msg-Id": f"{first['event_id']}..{last['event_id']}"},
                    b"[" + b",".join(_envelope(store, row) for row in rows) + b"]")


def _envelope(store: EventStore, row: asyncpg.Record) -> bytes:
    """The envelope of the event of `row`, encoded."""
    data = encode(_Published(event_id=str(row["event_id"]), service=store.service,
                             aggregate_type=row["aggregate_type"], aggregate_id=row["aggregate_id"],
                             version=row["version"], position=row["position"], recorded_at=row["recorded_at"],
                             event=msgspec.Raw(row["data"]), trace=msgspec.Raw(row["trace"])))
    if len(data) > MAX_EVENT_BYTES:  # PostgreSQL's text of it is roomier than ours, which the append kept within
        data = encode(store.envelope(row))
    return data


def bundles(rows: Sequence[asyncpg.Record]) -> Iterator[list[asyncpg.Record]]:
    """The rows as they are published: the consecutive events of one kind of aggregate that one append recorded (one
    transaction, `xmin`) together, at most BUNDLE_EVENTS and about BUNDLE_BYTES; set-aside records alone, for the
    monitor follows them by their event's name (`subjects.SET_ASIDE_ALL`)."""
    return _cut(rows, BUNDLE_EVENTS, BUNDLE_BYTES, lambda first, row: (
        row["xmin"] != first["xmin"] or row["aggregate_type"] != first["aggregate_type"]
        or row["aggregate_type"] == SET_ASIDE_AGGREGATE))


class OutboxRelay:
    def __init__(self, store: EventStore, js: JetStreamContext, *, poll_seconds: float = 1.0,
                 batch: int = 500, ack_seconds: float = ACK_SECONDS) -> None:
        self.store = store
        self.js = js
        self.poll_seconds = poll_seconds
        self.batch = batch
        self.ack_seconds = ack_seconds
        self._wake = asyncio.Event()
        self.published_position = 0  # the last event acknowledged, with none missing before it
        # Acknowledged but not written yet: it is written with the next read of events (see publish_pending).
        self._unsaved: int | None = None

    async def lag(self) -> int:
        """Events stored but not yet published (acknowledged by JetStream), as far as this relay or the one before
        it got."""
        schema = self.store.schema
        return int(await self.store.pool.fetchval(
            f"SELECT (SELECT coalesce(max(position), 0) FROM {schema}.events)"
            f" - greatest((SELECT published_position FROM {schema}.relay), $1::bigint)", self.published_position))

    async def run(self) -> None:
        """Publish forever; wakes on the store's NOTIFY and polls as a fallback."""
        conn = await self.store.pool.acquire()
        try:
            await conn.execute("SELECT pg_advisory_lock($1)", self.store.lock_key + 2)
            await conn.add_listener(self.store.notify_channel, self._on_notify)
            checked = -HISTORY_CHECK_SECONDS
            while True:
                self._wake.clear()
                if asyncio.get_running_loop().time() - checked >= HISTORY_CHECK_SECONDS:
                    checked = asyncio.get_running_loop().time()
                    try:
                        await self.rewind_if_history_lost()
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # NATS away: publishing waits for it anyway; look again later
                        log.warning("relay.history_unchecked", store=self.store.service, error=repr(exc))
                try:
                    while await self.publish_pending() == self.batch:
                        pass
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("relay.publish_failed", store=self.store.service)
                    await asyncio.sleep(self.poll_seconds)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
                # that arrives together with a wake-up, and the relay would then never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_seconds):
                        await self._wake.wait()
        finally:
            await self._let_go(conn)

    async def _let_go(self, conn: asyncpg.pool.PoolConnectionProxy) -> None:
        """Write down how far it published, stop listening, give the lock and the connection back: at most
        `LET_GO_SECONDS` in all. asyncpg gives a connection back to its pool shielded from cancellation and, without a
        timeout, for as long as resetting it takes: a stop once waited 10 s there. A connection not given back in
        time is closed instead (its lock goes with it)."""
        try:
            async with asyncio.timeout(LET_GO_SECONDS):
                with contextlib.suppress(Exception):
                    await self._save()
                await conn.remove_listener(self.store.notify_channel, self._on_notify)
                await conn.execute("SELECT pg_advisory_unlock($1)", self.store.lock_key + 2)
                await self.store.pool.release(conn)
        except Exception as exc:  # a timeout included
            log.warning("relay.connection_closed", store=self.store.service, error=repr(exc))
            conn.terminate()
        except BaseException:  # cancelled again meanwhile: closed all the same
            conn.terminate()
            raise

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def rewind_if_history_lost(self) -> int:
        """Publish again from the newest of this store's events the stream still has, when that is behind
        the recorded position (the stream lost events); returns the position published from."""
        schema = self.store.schema
        recorded = int(await self.store.pool.fetchval(f"SELECT published_position FROM {schema}.relay"))
        recorded = max(recorded, self._unsaved or 0)
        if not recorded:
            return recorded
        try:
            newest = await self.js.get_last_msg(EVENTS_STREAM, events_of_service(self.store.service))
        except NotFoundError:
            newest = None
        # Not an envelope of ours: what it says cannot be trusted.
        envelopes = stored_envelopes(newest.subject or "", newest.data or b"") if newest is not None else []
        kept = envelopes[-1].position if envelopes else 0
        if kept >= recorded:
            return recorded
        log.warning("relay.history_lost", store=self.store.service, published=recorded, still_in_stream=kept)
        self._unsaved = None
        await self.store.pool.execute(f"UPDATE {schema}.relay SET published_position = $1", kept)
        self.published_position = kept
        return kept

    async def publish_pending(self) -> int:
        """Publish one batch of unpublished events; return how many were published.

        The position reached is written with the next read of events, in the same statement, rather than by
        a write of its own: a burst costs one statement per batch. The relay reads again at least every
        `poll_seconds`; a crash before that publishes the last batch again, which JetStream drops.
        """
        schema = self.store.schema
        unsaved, self._unsaved = self._unsaved, None
        try:
            rows = await self.store.pool.fetch(
                f"""WITH saved AS (UPDATE {schema}.relay SET published_position = $2 WHERE published_position < $2)
                    SELECT xmin, * FROM {schema}.events
                    WHERE position > greatest((SELECT published_position FROM {schema}.relay), $2)
                    ORDER BY position LIMIT $1""",
                self.batch, unsaved,
            )
        except BaseException:
            self._unsaved = self._unsaved or unsaved
            raise
        published = 0
        try:
            for run in _runs(rows):
                messages = [outgoing(self.store, bundle) for bundle in bundles(run)]
                acknowledged = await self._publish_run(messages)
                published += sum(message.events for message in messages[:acknowledged])
                if acknowledged < len(messages):
                    raise PublishUnacknowledged(f"JetStream acknowledged {acknowledged} of {len(messages)} messages")
        finally:
            if published:
                self.published_position = self._unsaved = rows[published - 1]["position"]
        return published

    async def _save(self) -> None:
        """Write the position reached now (the relay stops)."""
        if (unsaved := self._unsaved) is not None:
            await self.store.pool.execute(
                f"UPDATE {self.store.schema}.relay SET published_position = $1 WHERE published_position < $1", unsaved)
            self._unsaved = None

    async def _publish_run(self, messages: list[Outgoing]) -> int:
        """Publish `messages` all at once, then wait for their acknowledgements; return how many, from the
        first, JetStream acknowledged.

        The order of the stream is the order of the log, which followers rely on. All of a run is handed to
        the connection without a pause (nothing here waits between two publishes, and a run is kept well
        within the client's buffers), so it leaves on one connection in order: if that connection breaks, the
        server has kept a first part of the run, never a later event without an earlier one. What follows
        the first event without an acknowledgement is published again (JetStream drops what it already has).
        """
        acks: list[asyncio.Future[PubAck]] = []
        try:
            for message in messages:
                acks.append(await self.js.publish_async(message.subject, message.data, headers=message.headers))
        finally:
            await _settled(acks, self.ack_seconds)
        acknowledged = next((i for i, ack in enumerate(acks) if ack.cancelled() or ack.exception()), len(acks))
        if acknowledged < len(acks):
            failed = acks[acknowledged]
            log.warning("relay.unacknowledged", store=self.store.service, position=messages[acknowledged].position,
                        error="no acknowledgement" if failed.cancelled() else repr(failed.exception()))
            if any(not ack.cancelled() and not ack.exception() for ack in acks[acknowledged:]):
                log.error("relay.acknowledged_out_of_order", store=self.store.service,
                          position=messages[acknowledged].position)
        return acknowledged


class PublishUnacknowledged(Exception):
    """JetStream did not acknowledge every event of a run (NATS away or slow); they are published again."""


def _runs(rows: list[asyncpg.Record]) -> Iterator[list[asyncpg.Record]]:
    """The rows in runs of at most RUN_EVENTS events and about RUN_BYTES bytes (a larger event alone); a run is
    published before its acknowledgements are awaited."""
    return _cut(rows, RUN_EVENTS, RUN_BYTES, lambda first, row: False)


def _cut(rows: Sequence[asyncpg.Record], events: int, size: int,
         apart: Callable[[asyncpg.Record, asyncpg.Record], bool]) -> Iterator[list[asyncpg.Record]]:
    """The rows in consecutive groups of at most `events` events and about `size` bytes (a larger event alone), each
    row `apart` from its group's first beginning the next."""
    group: list[asyncpg.Record] = []
    taken = 0
    for row in rows:
        row_size = len(row["data"]) + ENVELOPE_BYTES
        if group and (len(group) == events or taken + row_size > size or apart(group[0], row)):
            yield group
            group, taken = [], 0
        group.append(row)
        taken += row_size
    if group:
        yield group


async def _settled(acks: list[asyncio.Future[PubAck]], seconds: float) -> None:
    """Wait until every acknowledgement came, or until none came for `seconds`; cancel those still awaited."""
    waiting = [ack for ack in acks if not ack.done()]
    while waiting:
        done, still = await asyncio.wait(waiting, timeout=seconds)
        if not done:
            break
        waiting = list(still)
    for ack in waiting:
        ack.cancel()
