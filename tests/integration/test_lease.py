"""One active instance per service: the lease, its takeover, and the fencing of a holder that lost it.
Against the real PostgreSQL; the services' own standby is started in this process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from nats.aio.client import Client

from libs.auth import issue_token
from libs.contracts.events import NodeRecovered
from libs.contracts.identity import Identity
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError
from libs.eventstore import EventStore, NewEvent
from libs.eventstore.lease import Lease, LeaseLost
from libs.messaging.rpc import ServiceUnavailable, call
from libs.settings import Settings
from tests.support.monitor import start_monitor
from tests.support.stores import StoreFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Long enough that a holder is still seen holding it in the next statement, however loaded the machine.
TTL = 2.0
SECRET = "lease-tests-signing-secret-0123456789abcdef"


async def append(store: EventStore, node: str) -> None:
    await store.append([NewEvent("node", node, NodeRecovered(node_name=node))], expected_versions={("node", node): 0})


async def test_a_holder_that_stopped_renewing_is_taken_over_and_can_never_write_again(
        make_store: StoreFactory) -> None:
    first_store, second_store = await make_store("monitor"), await make_store("monitor")
    first = Lease(first_store.pool, "monitor", holder="first", ttl_seconds=TTL)
    second = Lease(second_store.pool, "monitor", holder="second", ttl_seconds=TTL)
    first_store.epoch = await first.acquire()
    assert await second.try_acquire() is None  # held and renewed: nobody else acts
    await append(first_store, "node-a")

    await asyncio.sleep(TTL * 1.5)  # the first holder is paused: it renews nothing
    second_store.epoch = await second.acquire(poll_seconds=0.05)

    assert second_store.epoch == first_store.epoch + 1
    with pytest.raises(LeaseLost):
        await append(first_store, "node-b")  # woke up: fenced, before it even learns it lost the lease
    with pytest.raises(LeaseLost):
        await first.renew()
    await append(second_store, "node-b")
    assert [e.aggregate_id async for e in second_store.read_all()] == ["node-a", "node-b"]


async def test_a_lease_given_up_is_taken_at_once(make_store: StoreFactory) -> None:
    store = await make_store("monitor")
    first = Lease(store.pool, "monitor", holder="first", ttl_seconds=3600)
    second = Lease(store.pool, "monitor", holder="second", ttl_seconds=3600)
    await first.acquire()
    assert await second.try_acquire() is None

    await first.give_up()

    assert await second.try_acquire() == 2


async def test_a_standby_service_answers_nothing_until_the_active_one_stops(
        nats_url: str, database_url: str, nc: Client) -> None:
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET)
    admin = issue_token(SECRET, Identity(user="root", projects=[], admin=True))
    active, _ = await start_monitor(settings)
    standby = asyncio.create_task(start_monitor(dataclasses.replace(settings)))
    try:
        await asyncio.sleep(2)
        assert not standby.done()  # waiting for the lease: no second monitor acts beside the first
        assert active.store.epoch == 1

        await active.close()
        async with asyncio.timeout(60):
            runtime, _ = await standby

        assert runtime.store.epoch == 2
        page = None
        async with asyncio.timeout(60):
            while page is None:
                with contextlib.suppress(ServiceUnavailable):
                    page = await call(nc, LIST_ALERTS.subject, ListAlerts(), token=admin, timeout=2,
                                      reply_type=AlertPage | CommandError)
        assert isinstance(page, AlertPage)
        await runtime.close()
    finally:
        if not standby.done():
            standby.cancel()
        await active.close()
