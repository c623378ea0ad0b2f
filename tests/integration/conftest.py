"""Connections for integration tests: a JetStream client, event stores in the test database, and
schedulers run in the test's process with clients logged in to them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest_asyncio
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.eventstore import EventStore
from libs.messaging.connection import ensure_streams
from libs.settings import Settings
from tests.support.monitor import start_monitor
from tests.support.schedulers import SECRET, Login, Schedulers, logins, token
from tests.support.stores import StoreFactory


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


@pytest_asyncio.fixture(loop_scope="session")
async def schedulers(nats_url: str, database_url: str, tmp_path: Path) -> AsyncIterator[Schedulers]:
    control = Schedulers(nats_url, database_url, tmp_path / "storage")
    yield control
    await control.stop_all()


@pytest_asyncio.fixture(loop_scope="session")
async def client(nats_url: str, schedulers: Schedulers) -> AsyncIterator[TrainyardClient]:
    """A scheduler started, and a client of alice's (project default) on it."""
    await schedulers.start()
    api = await TrainyardClient.open(nats_url, token=token("alice"))
    yield api
    await api.close()


@pytest_asyncio.fixture(loop_scope="session")
async def login(nats_url: str, database_url: str, tmp_path: Path) -> AsyncIterator[Login]:
    """Starts a scheduler, then opens clients as whoever the test names."""
    schedulers = Schedulers(nats_url, database_url, tmp_path / "storage")
    await schedulers.start()
    async with logins(nats_url) as open_as:
        yield open_as
    await schedulers.stop_all()


@pytest_asyncio.fixture(loop_scope="session")
async def lone_monitor(nats_url: str, database_url: str) -> AsyncIterator[None]:
    """A monitor of its own, with the tests' signing secret: no mail, and no node counted lost within a test."""
    settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, smtp_url=None,
                        alert_emails=(), node_lost_seconds=3600)
    runtime, _ = await start_monitor(settings)
    yield
    await runtime.close()
