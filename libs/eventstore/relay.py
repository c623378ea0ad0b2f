"""The transactional outbox relay: publishes a store's events to JetStream, in order, once.

The event table is the outbox. The relay reads events past its published position, publishes each
with `Nats-Msg-Id` = the event id and waits for JetStream's acknowledgement before moving the
position on. After a crash it publishes again from the last recorded position; JetStream's
duplicate window drops the repeats. A session advisory lock keeps one relay active per store.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.js import JetStreamContext

from libs.contracts.codec import encode
from libs.contracts.subjects import event_subject
from libs.eventstore.store import EventStore
from libs.telemetry.logs import get_logger

log = get_logger(__name__)


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
            while True:
                self._wake.clear()
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
