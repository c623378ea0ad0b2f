"""Connections for integration tests: a JetStream client, and event stores in the test database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import nats
import pytest_asyncio
from nats.aio.client import Client

from libs.eventstore import EventStore
from libs.messaging.connection import ensure_streams

StoreFactory = Callable[[str], Awaitable[EventStore]]


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


@pytest_asyncio.fixture(loop_scope="session")
async def make_store(database_url: str) -> AsyncIterator[StoreFactory]:
    """Opens the migrated event store of a named service (pools are closed after the test)."""
    pools: list[asyncpg.Pool] = []

    async def open_store(service: str) -> EventStore:
        pool = await asyncpg.create_pool(database_url, min_size=2, max_size=12)
        pools.append(pool)
        store = EventStore(pool, service)
        await store.migrate()
        return store

    yield open_store
    for pool in pools:
        await pool.close()
