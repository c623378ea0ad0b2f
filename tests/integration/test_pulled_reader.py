"""A pulled reader hands over a subject's messages a batch at a time, says when it is at the end for now, and then
hands over what was stored since on the same consumer: a past state read window by window makes one consumer per
source, not one per window. `read_pulled` reads a subject once, up to what it held, and leaves no consumer behind."""

from __future__ import annotations

import contextlib

import pytest
from nats.aio.client import Client

from libs.contracts import subjects
from libs.messaging.reader import PulledReader, delivered, read_pulled

pytestmark = pytest.mark.asyncio(loop_scope="session")

SUBJECT = "trainyard.events.launcher.launch.job-pulled000.LaunchEnded"


async def consumers(nc: Client, subject: str = SUBJECT) -> int:
    """The consumers reading `subject` (the test's)."""
    found = await nc.jetstream().consumers_info(subjects.EVENTS_STREAM)
    return sum(1 for info in found if info.config.filter_subject == subject)


async def test_a_reader_at_its_end_reads_on_from_there_on_the_same_consumer(nc: Client) -> None:
    js = nc.jetstream()
    first = [(await js.publish(SUBJECT, f"m{i}".encode())).seq for i in range(5)]
    await js.publish("trainyard.events.launcher.launch.job-other00000.LaunchEnded", b"not this subject")
    assert await consumers(nc) == 0
    reader = PulledReader(js, subjects.EVENTS_STREAM, SUBJECT, after=first[0], batch=3)
    try:
        batches = [await reader.fetch(), await reader.fetch()]
        assert [[m.data for m in batch] for batch in batches] == [[b"m1", b"m2", b"m3"], [b"m4"]]
        assert [delivered(m)[0] for batch in batches for m in batch] == first[1:]
        assert await reader.fetch() == []  # the end, for now
        assert await consumers(nc) == 1

        later = (await js.publish(SUBJECT, b"m5")).seq
        (msg,) = await reader.fetch()
        assert (msg.data, delivered(msg)[0]) == (b"m5", later)
        assert await reader.fetch() == []
        assert await consumers(nc) == 1  # the same consumer all along
    finally:
        await reader.close()
    assert await consumers(nc) == 0  # closed: removed at once


async def test_a_reader_whose_consumer_was_removed_goes_on_after_the_last_message_fetched(nc: Client) -> None:
    """A reader left idle longer than the server keeps its consumer (a past state folding a long window while one
    source waits) takes up where it was, each message once."""
    js = nc.jetstream()
    subject = SUBJECT.replace("pulled000", "pulled001")
    sent = [(await js.publish(subject, f"n{i}".encode())).seq for i in range(4)]
    reader = PulledReader(js, subjects.EVENTS_STREAM, subject, after=sent[0] - 1, batch=2)
    try:
        first = await reader.fetch()
        (gone,) = [info.name for info in await js.consumers_info(subjects.EVENTS_STREAM)
                   if info.config.filter_subject == subject]
        await js.delete_consumer(subjects.EVENTS_STREAM, gone)
        rest = await reader.fetch()
        assert [m.data for m in first + rest] == [b"n0", b"n1", b"n2", b"n3"]
        assert await reader.fetch() == []
    finally:
        await reader.close()


async def test_a_read_to_the_end_stops_at_what_was_stored_and_one_closed_early_leaves_no_consumer(nc: Client) -> None:
    """A page of a metric series reads a job's subject from a position on: it ends at what was stored when it
    began, however many batches that takes, and a page that stops early removes its consumer at once."""
    js = nc.jetstream()
    subject = SUBJECT.replace("pulled000", "pulled002")
    sent = [(await js.publish(subject, f"p{i}".encode())).seq for i in range(7)]
    read = []
    async with contextlib.aclosing(read_pulled(js, subjects.EVENTS_STREAM, subject, after=sent[1], batch=2)) as msgs:
        async for msg in msgs:
            read.append(msg.data)
            if len(read) == 1:  # stored while it reads: not part of this read
                await js.publish(subject, b"later")
    assert read == [b"p2", b"p3", b"p4", b"p5", b"p6"]
    assert await consumers(nc, subject) == 0

    async with contextlib.aclosing(read_pulled(js, subjects.EVENTS_STREAM, subject, batch=2)) as msgs:
        assert (await anext(msgs)).data == b"p0"
        assert await consumers(nc, subject) == 1
    assert await consumers(nc, subject) == 0  # closed after one message: removed
    assert [m.data async for m in read_pulled(js, subjects.EVENTS_STREAM, "trainyard.events.launcher.launch."
                                              "job-pulled003.LaunchEnded")] == []  # nothing stored: nothing read
