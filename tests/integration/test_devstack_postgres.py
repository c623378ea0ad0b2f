"""The local stack's PostgreSQL keeps what it acknowledged through a crash of PostgreSQL itself: a
commit returns once its WAL is with the OS (synchronous_commit on), even though it does not fsync."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

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
