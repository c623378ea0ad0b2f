"""Reading one subject of a JetStream stream from its first message, to the end or while following."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError


async def next_stored(js: JetStreamContext, stream: str, subject: str, after: int) -> RawStreamMsg | None:
    """The first message on `subject` (wildcards allowed) stored after sequence `after`, or None. The server
    finds it through its subject index: no consumer is made, and no other subject's message is handed over."""
    try:
        return await js.get_msg(stream, seq=after + 1, subject=subject, next=True)
    except NotFoundError:  # nothing (more) on the subject
        return None


async def read_subject(js: JetStreamContext, stream: str, subject: str, *, after: int = 0,
                       follow: Awaitable[Any] | None = None) -> AsyncGenerator[Msg, None]:
    """Messages on `subject` of `stream` stored after sequence `after` (0: from the start); stop at its end,
    or when `follow` completes.

    An ordered consumer is ephemeral and flow-controlled: nothing is left behind on the server, and the
    server pushes the messages without a round trip each, as `next_stored` takes. Close the iterator (or
    read it to its end) to remove the consumer at once.
    """
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        await queue.put(msg)

    start = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1) if after else None
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=start,
                             deliver_policy=None if after else DeliverPolicy.ALL, cb=on_message)
    stopper = asyncio.ensure_future(follow) if follow is not None else None
    try:
        info = await sub.consumer_info()
        if stopper is None and not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
            return
        while True:
            getter = asyncio.ensure_future(queue.get())
            waiting: set[asyncio.Future[Any]] = {getter}
            if stopper is not None:
                waiting.add(stopper)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                return
            msg = getter.result()
            yield msg
            if stopper is None and not msg.metadata.num_pending:
                return
    finally:
        if stopper is not None:
            stopper.cancel()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
