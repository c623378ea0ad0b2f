"""Core NATS messages handled in batches: everything that arrived since the handler's last call, in one call.

For a subject whose messages come by the thousand a second and mostly change nothing (node heartbeats),
faststream's per-message machinery (its context, dependency injection and middlewares) was most of the cost:
about 100 of the monitor's 140 µs per heartbeat, by py-spy under `bench.capacity`. Here nats-py hands each
message to a callback that only queues it, and one task hands the handler all that waits, so that the handler
takes its lock once for many messages. A handler that fails loses its batch (logged), which suits messages that are
sent again anyway (a heartbeat every few seconds); what waits is bounded, and what comes beyond that is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.telemetry.logs import get_logger

log = get_logger(__name__)
# At most this many messages wait for the handler: at 10,000 nodes' heartbeats every 2 s, 10 s of them.
MAX_WAITING = 50_000


class Batches:
    """Messages of one subscription, handed to `handle` in the order they arrived, as many at a time as wait."""

    def __init__(self, handle: Callable[[list[Msg]], Awaitable[None]], *, limit: int = MAX_WAITING) -> None:
        self.handle = handle
        self.limit = limit
        self.dropped = 0  # messages that came while `limit` waited, since the last batch
        self._waiting: list[Msg] = []
        self._arrival = asyncio.Event()
        self._subscription: Subscription | None = None

    async def subscribe(self, nc: Client, subject: str, *, queue: str) -> None:
        """Take `subject`'s messages (as one of `queue`'s members) from now on; nats-py subscribes again
        after a reconnection."""
        if self._subscription is None:
            self._subscription = await nc.subscribe(subject, queue=queue, cb=self._arrived)

    async def _arrived(self, msg: Msg) -> None:
        if len(self._waiting) >= self.limit:
            self.dropped += 1
            return
        self._waiting.append(msg)
        self._arrival.set()

    async def run(self) -> None:
        """Hand over what waits, batch after batch, for the life of the subscription."""
        while True:
            await self._arrival.wait()
            self._arrival.clear()
            batch, self._waiting = self._waiting, []
            if self.dropped:
                log.warning("batches.dropped", subject=batch[0].subject, dropped=self.dropped, waiting=len(batch),
                            hint="the handler falls behind its messages")
                self.dropped = 0
            try:
                await self.handle(batch)
            except Exception as exc:  # as a subscriber would: the next batch is handled all the same
                log.exception("batches.handler_failed", subject=batch[0].subject, messages=len(batch), error=repr(exc))
