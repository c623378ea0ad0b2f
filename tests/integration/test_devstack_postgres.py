"""The local stack's PostgreSQL keeps what it acknowledged through a crash of PostgreSQL itself: a
commit returns once its WAL is with the OS (synchronous_commit on), even though it does not fsync. Its
processes reach it through its Unix socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from libs.devstack.provision import Servers
from libs.devstack.servers import create_database, postgres_url, start_postgres
from tests.support.postgres import crash_postgres, private_postgres


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    with private_postgres(tmp_path) as server:
        yield server


async def test_acknowledged_commits_survive_a_crash_of_postgres(postgres: tuple[Path, int]) -> None:
    folder, port = postgres
    await create_database(postgres_url(port, "postgres"), "trainyard")
    conn = await asyncpg.connect(postgres_url(port, "trainyard"))
    await conn.execute("CREATE TABLE submissions (job_id text PRIMARY KEY)")
    acknowledged = [f"job-{n:012x}" for n in range(200)]
    for job_id in acknowledged:  # each a transaction of its own, acknowledged before the next
        await conn.execute("INSERT INTO submissions VALUES ($1)", job_id)
    crash_postgres(folder)
    conn.terminate()

    start_postgres(folder, port)
    conn = await asyncpg.connect(postgres_url(port, "trainyard"))
    try:
        kept = [row["job_id"] for row in await conn.fetch("SELECT job_id FROM submissions ORDER BY job_id")]
    finally:
        await conn.close()
    assert kept == acknowledged


async def test_the_stacks_processes_reach_it_through_its_unix_socket(postgres: tuple[Path, int]) -> None:
    folder, port = postgres
    url = postgres_url(port, "postgres", socket_dir=folder)
    # Servers.database_url names another database on the same server, through the same socket.
    assert Servers("nats://unused", url).database_url("trainyard") == postgres_url(port, "trainyard", socket_dir=folder)
    await create_database(url, "trainyard")
    conn = await asyncpg.connect(postgres_url(port, "trainyard", socket_dir=folder))
    try:
        # No server address: the connection is not over TCP.
        assert await conn.fetchval("SELECT inet_server_addr()") is None
        assert await conn.fetchval("SELECT current_database()") == "trainyard"
    finally:
        await conn.close()
    tcp = await asyncpg.connect(postgres_url(port, "trainyard"))
    try:
        assert str(await tcp.fetchval("SELECT inet_server_addr()")) == "127.0.0.1"
    finally:
        await tcp.close()
