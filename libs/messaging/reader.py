"""Reading one subject of a JetStream stream from its first message, to the end or while following."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg, StatusCode
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

PULLED_IDLE_SECONDS = 30.0
FETCH_SECONDS = 5.0
_V1_TOKENS = 9  # in the older form of a delivered message's reply subject (`delivered`)


def delivered(msg: Msg) -> tuple[int, int]:
    """(stream sequence, messages pending) of a message a JetStream consumer delivered, read off its reply subject.

    nats-py's `msg.metadata` makes two frozen dataclasses and a datetime for every message: a quarter of a
    follower's time while it replays a long stream (bench/replay.py), for two numbers. The reply subject is
    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`, or in the newer form
    with a domain and an account hash after `$JS.ACK` (nats-py's `Msg.Ack` names those places); any other shape is
    left to nats-py."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == [Msg.Ack.Prefix0, Msg.Ack.Prefix1]:
        if len(tokens) == _V1_TOKENS:
            return int(tokens[5]), int(tokens[8])
        if len(tokens) > Msg.Ack.NumPending:
            return int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.NumPending])
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.num_pending


def stream_sequence(msg: Msg | None) -> int:
    """The stream sequence of a message a JetStream consumer delivered; 0 for any other (none, or one sent to a
    subject by hand, as tests do)."""
    if msg is None or not (msg.reply or "").startswith(f"{Msg.Ack.Prefix0}.{Msg.Ack.Prefix1}."):
        return 0
    return delivered(msg)[0]


async def next_stored(js: JetStreamContext, stream: str, subject: str, after: int) -> RawStreamMsg | None:
    """The first message on `subject` (wildcards allowed) stored after sequence `after`, or None. The server
    finds it through its subject index: no consumer is made, and no other subject's message is handed over."""
    try:
        return await js.get_msg(stream, seq=after + 1, subject=subject, next=True)
    except NotFoundError:  # nothing (more) on the subject
        return None


async def read_pulled(js: JetStreamContext, stream: str, subject: str, *, after: int = 0,
                      batch: int = 16) -> AsyncGenerator[Msg, None]:
    """Messages on `subject` of `stream` stored after sequence `after` (0: from the start), up to those there
    when its first batch came, fetched `batch` at a time by an ephemeral pull consumer (`PulledReader`).

    Only what is fetched is sent: a reader that stops early (a page of a series) costs what it read, where
    an ordered consumer's server pushes on ahead. The consumer is deleted when the iterator is closed.
    """
    reader = PulledReader(js, stream, subject, after=after, batch=batch)
    try:
        msgs = await reader.fetch()
        left = len(msgs) + reader.left
        while msgs:
            for msg in msgs[:left]:
                yield msg
            left -= len(msgs)
            msgs = await reader.fetch() if left > 0 else []
    finally:
        await reader.close()


def _pulled_config(after: int, subjects: Sequence[str] = ()) -> ConsumerConfig:
    """An ephemeral pull consumer's, from sequence `after` on (0: the first), of `subjects` (none: the
    subscription's own filter)."""
    start = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1) if after
             else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    start.ack_policy, start.mem_storage, start.num_replicas = AckPolicy.NONE, True, 1
    start.inactive_threshold = PULLED_IDLE_SECONDS  # removed by the server if this reader vanishes
    if len(subjects) > 1:
        start.filter_subjects = list(subjects)
    elif subjects:
        start.filter_subject = subjects[0]
    return start


class PulledReader:
    """Messages on `subject` of `stream` (or on any of several subjects) stored after sequence `after`, fetched
    `batch` at a time by an ephemeral pull consumer, only when asked: a reader at the end keeps its consumer, and
    is handed what was stored since when asked again, without a consumer made anew (a JetStream request of its
    own, slow on a busy server). One left idle past `PULLED_IDLE_SECONDS`, which the server removes, is made again
    after the last message fetched; close the reader to remove it at once.

    A batch is asked for as JetStream's pull protocol asks (`CONSUMER.MSG.NEXT`, `no_wait`) and delivered to a
    subscription of its own, which takes each message as it comes: nats-py's `fetch` waits for every message of a
    batch in a task of its own, five times the CPU of an ordered consumer's delivery (34 against 6.5 µs a message
    here), which made a follower's catch-up after a restart twice as long."""

    def __init__(self, js: JetStreamContext, stream: str, subject: str | Sequence[str], *, after: int = 0,
                 batch: int = 16) -> None:
        self.js, self.stream, self.after, self.batch = js, stream, after, batch
        self.subjects = [subject] if isinstance(subject, str) else list(subject)
        self._name = ""  # the consumer's, once made
        self._left = 0  # stored and not yet fetched, as the last message fetched told (0: ask the server)

    @property
    def left(self) -> int:
        """Messages stored and not yet fetched, as the last one fetched told (0 at the end, or before any)."""
        return self._left

    async def fetch(self) -> list[Msg]:
        """The next messages stored, at most `batch`; none: nothing more for now."""
        try:
            return await self._fetch()
        except (NotFoundError, ServiceUnavailableError, nats.errors.TimeoutError):  # removed while idle: made again
            await self.close()
            return await self._fetch()

    async def _fetch(self) -> list[Msg]:
        if not self._name:
            info = await self.js.add_consumer(self.stream, _pulled_config(self.after, self.subjects))
            self._name, self._left = info.name, info.num_pending or 0
        if not self._left:
            self._left = (await self.js.consumer_info(self.stream, self._name)).num_pending or 0
            if not self._left:
                return []
        msgs = await self._ask(min(self.batch, self._left))
        if msgs:
            self.after, self._left = delivered(msgs[-1])
        else:
            self._left = 0
        return msgs

    async def _ask(self, count: int) -> list[Msg]:
        nc = self.js._nc  # the connection the context was made from
        batch = _Batch(count)
        reply = nc.new_inbox()
        sub = await nc.subscribe(reply, cb=batch.take)
        try:
            await nc.publish(f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{self.stream}.{self._name}",
                             json.dumps({"batch": count, "no_wait": True}).encode(), reply=reply)
            await asyncio.wait_for(asyncio.shield(batch.ended), FETCH_SECONDS)
        except TimeoutError:
            raise nats.errors.TimeoutError from None  # what came of it is dropped: read again from `after`
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if batch.refused and not batch.msgs:  # the consumer is gone (removed while idle), or the server refuses
            raise NotFoundError(description=f"a pull request answered {batch.refused}")
        return batch.msgs

    async def close(self) -> None:
        if not self._name:
            return
        name, self._name, self._left = self._name, "", 0
        with contextlib.suppress(Exception):
            await self.js.delete_consumer(self.stream, name)


class _Batch:
    """One pull request's messages, as they are delivered."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.msgs: list[Msg] = []
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.refused = ""  # the status the server ended it with, when not "no more now" or "expired"

    async def take(self, msg: Msg) -> None:
        if self.ended.done():
            return
        status = JetStreamContext.is_status_msg(msg)
        if status == StatusCode.CONTROL_MESSAGE:
            return
        if status:  # the batch ends: no more messages now (404), or the request expired (408), or refused
            if status not in (StatusCode.NO_MESSAGES, StatusCode.REQUEST_TIMEOUT):
                self.refused = status
            self.ended.set_result(None)
            return
        self.msgs.append(msg)
        if len(self.msgs) >= self.count:
            self.ended.set_result(None)


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
            if not queue.empty():  # no task and no wait for a message already here: a long read's every message
                msg = queue.get_nowait()
            elif stopper is None:
                msg = await queue.get()
            else:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    while not queue.empty():
                        yield queue.get_nowait()
                    return
                msg = getter.result()
            yield msg
            if stopper is None and not delivered(msg)[1]:
                return
    finally:
        if stopper is not None:
            stopper.cancel()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
