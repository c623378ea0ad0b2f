"""A service loop outlives the database or NATS going away; a bug still stops the service, and a stop ends it even
where a client library swallowed the stop's cancellation or turned it into an outage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import asyncpg
import nats.errors
import pytest

from libs.outages import is_outage
from libs.skeleton.eventsourced import Pacer, Period, weathering

PAUSES = (0.001, 0.004, 30.0)


async def test_a_loop_starts_again_after_each_outage_until_it_ends() -> None:
    outages = [asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
               nats.errors.ConnectionClosedError(), ConnectionRefusedError(111, "refused"),
               asyncpg.exceptions.InternalClientError("cannot switch to state 11; another operation is in progress")]
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if outages:
            raise outages.pop(0)

    await weathering("cycle", loop, PAUSES)

    assert runs == 5


async def test_a_bug_in_a_loop_is_not_taken_for_an_outage() -> None:
    async def loop() -> None:
        raise KeyError("job-1")

    with pytest.raises(KeyError):
        await weathering("cycle", loop, PAUSES)
    assert not is_outage(KeyError("job-1")) and not is_outage(ValueError("bad"))


async def test_a_stop_ends_a_loop_whose_cancellation_a_client_turned_into_an_outage() -> None:
    """As a connection closed under a request does: the loop is not paused and run again, it ends at once."""
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise nats.errors.TimeoutError from None

    task = asyncio.create_task(weathering("dispatch", loop, (5.0, 5.0, 30.0)))
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert done and task.cancelled() and runs == 1


@pytest.mark.parametrize("pace", [Pacer, lambda: Period(0.0)])
async def test_a_stop_ends_a_paced_loop_whose_cancellation_a_client_swallowed(pace: Callable[[], Pacer | Period]
                                                                              ) -> None:
    """nats-py swallows a cancellation that lands inside a publish: the loop's next turn ends it."""
    pacer = pace()
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            await pacer.turn()
            turns += 1
            with contextlib.suppress(asyncio.CancelledError):  # swallowed
                await asyncio.sleep(0.01)  # a publish

    task = asyncio.create_task(weathering("dispatch", loop, PAUSES))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert done and task.cancelled() and turns > 1
