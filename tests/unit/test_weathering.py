"""A service loop outlives the database or NATS going away; a bug still stops the service."""

from __future__ import annotations

import asyncpg
import nats.errors
import pytest

from libs.outages import is_outage
from libs.skeleton.eventsourced import weathering

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
