"""Per-user limits on creating jobs, through the client on a real scheduler (NATS and PostgreSQL): a user
past the queued limit or submitting faster than the bucket allows is refused, told why and what to do, and
nothing is created, while other users go on submitting; administrators change the limits and they apply at
once. The scheduler's clock is a stand-in the test moves, so no test waits for the bucket to refill.

No node agents run here, so every job stays queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

from tests.support.schedulers import Login, Schedulers, logins, refused, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Clock:
    """The scheduler's clock, standing still until the test moves it."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest_asyncio.fixture(loop_scope="session")
async def clock(schedulers: Schedulers) -> Clock:
    """A scheduler started, on a clock the test moves."""
    await schedulers.start()
    stand_in = Clock()
    schedulers.started[-1].clock = stand_in
    return stand_in


@pytest_asyncio.fixture(loop_scope="session")
async def login(nats_url: str, clock: Clock) -> AsyncIterator[Login]:
    """Clients as whoever the test names, of the scheduler on the test's clock."""
    async with logins(nats_url) as open_as:
        yield open_as


async def test_the_job_past_a_users_queued_limit_is_refused_while_others_submit(login: Login) -> None:
    alice = await login("alice", "default", "vision")
    bob = await login("bob")
    admin = await login("root", admin=True)
    assert (await admin.settings()).max_queued_jobs_per_user == 10_000  # the default
    assert (await refused(alice.change_settings(max_queued_jobs_per_user=1))).error.code == "forbidden"
    assert (await admin.change_settings(max_queued_jobs_per_user=3)).max_queued_jobs_per_user == 3

    first = (await alice.submit(spec("a"))).job_id
    await alice.clone(first)  # a clone is a submit
    await alice.submit(spec("b", project="vision"))  # every project together
    error = (await refused(alice.submit(spec("c")))).error
    assert error.code == "over-cap"
    assert "alice has 3 jobs queued" in error.message and "limit of 3" in error.message
    assert "trainyard stop" in (error.hint or "")
    assert (await refused(alice.clone(first))).error.code == "over-cap"
    assert len(await alice.list_jobs()) == 3  # nothing was created

    await bob.submit(spec("bobs"))  # another user is not held up
    await alice.stop([first])  # a queued job ended frees a place, for one job: not for an array of two
    error = (await refused(alice.submit_array(spec("sweep-{index}"), indices="0-1"))).error
    assert "this array of 2 jobs would make 4" in error.message
    await alice.submit_array(spec("one-{index}"), indices="0")
    assert len(await alice.list_jobs(["queued"])) == 3

    await admin.change_settings(max_queued_jobs_per_user=0)  # no limit
    await alice.submit(spec("d"))


async def test_a_burst_past_the_bucket_is_refused_until_it_refills(login: Login, clock: Clock) -> None:
    alice = await login("alice")
    bob = await login("bob")
    admin = await login("root", admin=True)
    settings = await admin.change_settings(submit_rate=1, submit_burst=3)
    assert (settings.submit_rate, settings.submit_burst) == (1, 3)

    # Three at once fill one batch or several; the fourth finds the bucket empty.
    await asyncio.gather(*(alice.submit(spec(f"burst-{i}")) for i in range(3)))
    error = (await refused(alice.submit(spec("one-more")))).error
    assert error.code == "over-cap"
    assert "alice submits too fast" in error.message and "0 are left" in error.message
    assert "1 jobs per second per user, up to 3 at once" in error.message
    assert error.hint == "wait 1 s and submit again; nothing was created"
    assert len(await alice.list_jobs()) == 3
    await bob.submit(spec("bobs"))  # bob's bucket is his own

    clock.advance(1)
    await alice.submit(spec("refilled"))
    error = (await refused(alice.submit_array(spec("a-{index}"), indices="0-1"))).error
    assert error.hint == "wait 2 s and submit again; nothing was created"
    error = (await refused(alice.submit_array(spec("a-{index}"), indices="0-3"))).error
    assert "split it into arrays of at most 3 jobs" in (error.hint or "")
    clock.advance(2)
    await alice.submit_array(spec("a-{index}"), indices="0-1")
    assert len(await alice.list_jobs()) == 6

    # Administrators are held to it too, until one lifts it.
    await asyncio.gather(*(admin.submit(spec(f"admin-{i}")) for i in range(3)))
    assert (await refused(admin.submit(spec("admin-more")))).error.code == "over-cap"
    await admin.change_settings(submit_rate=0)
    await asyncio.gather(*(alice.submit(spec(f"free-{i}")) for i in range(5)))
