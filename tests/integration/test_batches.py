"""`Batches` on real NATS: a busy handler gets everything that arrived meanwhile in one call, in order, and what
comes beyond the bound is dropped rather than held."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.messaging.batches import Batches
from libs.messaging.connection import round_trip

pytestmark = pytest.mark.asyncio(loop_scope="session")
WAIT_SECONDS = 30


async def arrived(batched: Batches, count: int) -> None:
    """Until `count` messages came while the handler held its batch: waiting for it, or dropped beyond its bound
    (the round trip got them to this connection; its subscription hands them over a moment later)."""
    async with asyncio.timeout(WAIT_SECONDS):
        while len(batched._waiting) + batched.dropped < count:
            await asyncio.sleep(0.01)


class HeldHandler:
    """A handler that keeps what it is handed and holds on to its first batch until `go_on` is set."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []
        self.first_taken, self.go_on = asyncio.Event(), asyncio.Event()

    async def __call__(self, batch: list[Msg]) -> None:
        self.batches.append([msg.data for msg in batch])
        self.first_taken.set()
        await self.go_on.wait()


async def test_what_arrives_while_the_handler_works_comes_in_one_batch_in_order(nc: Client) -> None:
    handle = HeldHandler()
    batches = handle.batches
    batched = Batches(handle)
    await batched.subscribe(nc, "trainyard.test.batches.one", queue="test")
    running = asyncio.create_task(batched.run())
    try:
        await nc.publish("trainyard.test.batches.one", b"0")
        await asyncio.wait_for(handle.first_taken.wait(), WAIT_SECONDS)
        for index in range(1, 201):  # while the first batch is still being handled
            await nc.publish("trainyard.test.batches.one", str(index).encode())
        await round_trip(nc)
        await arrived(batched, 200)
        handle.go_on.set()
        async with asyncio.timeout(WAIT_SECONDS):
            while sum(map(len, batches)) < 201:
                await asyncio.sleep(0.05)
        assert batches[0] == [b"0"]
        assert batches[1] == [str(index).encode() for index in range(1, 201)]
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_beyond_its_bound_a_batch_drops_what_comes_and_says_how_much(nc: Client) -> None:
    handle = HeldHandler()
    taken = handle.batches
    batched = Batches(handle, limit=10)
    await batched.subscribe(nc, "trainyard.test.batches.bound", queue="test")
    running = asyncio.create_task(batched.run())
    try:
        await nc.publish("trainyard.test.batches.bound", b"first")
        await asyncio.wait_for(handle.first_taken.wait(), WAIT_SECONDS)
        for index in range(25):
            await nc.publish("trainyard.test.batches.bound", str(index).encode())
        await round_trip(nc)
        await arrived(batched, 25)
        assert batched.dropped == 15
        handle.go_on.set()
        async with asyncio.timeout(WAIT_SECONDS):
            while len(taken) < 2:
                await asyncio.sleep(0.05)
        assert taken[1] == [str(index).encode() for index in range(10)]  # the first ten, the rest dropped
        assert batched.dropped == 0  # counted again from the next batch
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_handler_that_fails_loses_its_batch_and_gets_the_next(nc: Client) -> None:
    taken: list[bytes] = []

    async def handle(batch: list[Msg]) -> None:
        taken.extend(msg.data for msg in batch)
        if batch[0].data == b"bad":
            raise RuntimeError("a bug in the handler")

    batched = Batches(handle)
    await batched.subscribe(nc, "trainyard.test.batches.failing", queue="test")
    running = asyncio.create_task(batched.run())
    try:
        await nc.publish("trainyard.test.batches.failing", b"bad")
        await round_trip(nc)
        async with asyncio.timeout(WAIT_SECONDS):
            while not taken:
                await asyncio.sleep(0.02)
        await nc.publish("trainyard.test.batches.failing", b"good")
        async with asyncio.timeout(WAIT_SECONDS):
            while taken[-1] != b"good":
                await asyncio.sleep(0.02)
        assert not running.done()
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
