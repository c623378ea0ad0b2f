"""The transactional outbox relay: publishes a store's events to JetStream, in order, once.

The event table is the outbox. The relay reads events past its published position, publishes each
with `Nats-Msg-Id` = the event id and waits for JetStream's acknowledgement before moving the
position on. After a crash it publishes again from the last recorded position; JetStream's
duplicate window drops the repeats (and followers pass over repeats it no longer remembers). A
session advisory lock keeps one relay active per store.

JetStream may lose what it was given (the stream deleted and made anew, its store lost): at start,
and every HISTORY_CHECK_SECONDS, the relay looks at the newest of its service's events the stream
still has, and publishes again from there when that is behind what it recorded as published. So a
service that follows this one rebuilds the same view on its next start, whatever happened to NATS.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.contracts.codec import decode, encode
from libs.contracts.events import EventEnvelope
from libs.contracts.subjects import EVENTS_STREAM, event_subject, events_of_service
from libs.eventstore.store import EventStore
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
HISTORY_CHECK_SECONDS = 30.0


class OutboxRelay:
    def __init__(self, store: EventStore, js: JetStreamContext, *, poll_seconds: float = 1.0,
                 batch: int = 500) -> None:
        self.store = store
        self.js = js
        self.poll_seconds = poll_seconds
        self.batch = batch
        self._wake = asyncio.Event()
        self.published_position = 0

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
            with contextlib.suppress(Exception):
                await conn.remove_listener(self.store.notify_channel, self._on_notify)
                await conn.execute("SELECT pg_advisory_unlock($1)", self.store.lock_key + 2)
            await self.store.pool.release(conn)

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def rewind_if_history_lost(self) -> int:
        """Publish again from the newest of this store's events the stream still has, when that is behind
        the recorded position (the stream lost events); returns the position published from."""
        schema = self.store.schema
        recorded = int(await self.store.pool.fetchval(f"SELECT published_position FROM {schema}.relay"))
        if not recorded:
            return recorded
        try:
            newest = await self.js.get_last_msg(EVENTS_STREAM, events_of_service(self.store.service))
            kept = decode(newest.data or b"", EventEnvelope).position
        except NotFoundError:
            kept = 0
        except msgspec.DecodeError:  # not an envelope of ours: what it says cannot be trusted
            kept = 0
        if kept >= recorded:
            return recorded
        log.warning("relay.history_lost", store=self.store.service, published=recorded, still_in_stream=kept)
        await self.store.pool.execute(f"UPDATE {schema}.relay SET published_position = $1", kept)
        self.published_position = kept
        return kept

    async def publish_pending(self) -> int:
        """Publish one batch of unpublished events; return how many were published."""
        schema = self.store.schema
        position = await self.store.pool.fetchval(f"SELECT published_position FROM {schema}.relay")
        rows = await self.store.pool.fetch(
            f"SELECT * FROM {schema}.events WHERE position > $1 ORDER BY position LIMIT $2",
            position, self.batch,
        )
        for row in rows:
            envelope = self.store.envelope(row)
            subject = event_subject(envelope.service, envelope.aggregate_type, envelope.aggregate_id,
                                    type(envelope.event).name())
            headers = {"Nats-Msg-Id": envelope.event_id, **envelope.trace}
            await self.js.publish(subject, encode(envelope), headers=headers)
        if rows:
            last = rows[-1]["position"]
            await self.store.pool.execute(f"UPDATE {schema}.relay SET published_position = $1", last)
            self.published_position = last
        return len(rows)
