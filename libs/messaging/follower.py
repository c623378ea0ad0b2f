"""Following a JetStream stream from its start, with exactly-once reactions.

A service's view of other services (nodes from the monitor, launches from the launcher) is a fold
over their public events. On every start a follower reads the stream from the first message, so the
view is rebuilt the same way it was built: replay is the normal path. Each message is also offered
as a *reaction* when its stream sequence is past the position the service has recorded; the
reaction appends its events together with that position (see `EventStore.append(tracking=...)`), so
a restart never reacts twice and never skips one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from libs.contracts.codec import decode_any
from libs.eventstore.store import EventStore, Tracking
from libs.telemetry.logs import get_logger

log = get_logger(__name__)

Handler = Callable[[Any, Msg, Tracking | None], Awaitable[bool]]
"""handle(decoded, message, tracking): fold the decoded message into the view; when `tracking` is
given, also react to it and return True if the reaction's append carried `tracking` (False: the
follower records it)."""


class StreamFollower:
    def __init__(self, js: JetStreamContext, store: EventStore, *, stream: str, subject: str,
                 consumer: str, message_type: object, handle: Handler, reactions: bool = True,
                 retry_seconds: float = 0.5) -> None:
        self.js = js
        self.store = store
        self.stream = stream
        self.subject = subject
        self.consumer = consumer
        self.message_type = message_type
        self.handle = handle
        # A follower without reactions only folds: it never writes a tracking position.
        self.reactions = reactions
        self.retry_seconds = retry_seconds
        self.caught_up = asyncio.Event()
        self.tracked = 0
        self._sub: object | None = None

    async def start(self) -> None:
        if self.reactions:
            self.tracked = await self.store.tracked_position(self.consumer)
        sub = await self.js.subscribe(self.subject, stream=self.stream, ordered_consumer=True,
                                      deliver_policy=DeliverPolicy.ALL, cb=self._on_message)
        self._sub = sub
        # Nothing matched the filter yet (the consumer sequence counts matching deliveries only; the
        # stream sequence may already point past other services' messages): the view is complete.
        info = await sub.consumer_info()
        if not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
            self.caught_up.set()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()  # type: ignore[attr-defined]

    async def _on_message(self, msg: Msg) -> None:
        sequence = msg.metadata.sequence.stream
        tracking = Tracking(self.consumer, sequence) if self.reactions and sequence > self.tracked else None
        try:
            decoded = decode_any(msg.data, self.message_type)
        except msgspec.ValidationError as exc:
            # A message this version does not understand (a newer writer's type) is passed over.
            log.warning("follower.undecodable", consumer=self.consumer, subject=msg.subject, error=str(exc))
            decoded = None
        # The stream is read in order, so a failing handler is retried here rather than skipped.
        while True:
            try:
                recorded = decoded is not None and await self.handle(decoded, msg, tracking)
                if tracking is not None and not recorded:
                    await self.store.record_tracking(tracking)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("follower.handler_failed", consumer=self.consumer, sequence=sequence)
                await asyncio.sleep(self.retry_seconds)
        if tracking is not None:
            self.tracked = sequence
        if not msg.metadata.num_pending:
            self.caught_up.set()
