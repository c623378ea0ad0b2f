"""The local stack's PostgreSQL keeps what it acknowledged through a crash of PostgreSQL itself: a
commit returns once its WAL is with the OS (synchronous_commit on), even though it does not fsync."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest

from libs.devstack.servers import create_database, free_port, postgres_url, start_postgres, stop_postgres


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    tmp_path.chmod(0o755)  # the server runs as an unprivileged user when the tests run as root
    folder, port = tmp_path / "postgres", free_port()
    start_postgres(folder, port)
    yield folder, port
    stop_postgres(folder)


def crash(folder: Path) -> None:
    """kill -9 the server and every process of it, as a crash would end them."""
    server = psutil.Process(int((folder / "pgdata" / "postmaster.pid").read_text().splitlines()[0]))
    processes = [server, *server.children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=30)


async def test_acknowledged_commits_survive_a_crash_of_postgres(postgres: tuple[Path, int]) -> None:
    folder, port = postgres
    await create_database(postgres_url(port, "postgres"), "trainyard")
    conn = await asyncpg.connect(postgres_url(port, "trainyard"))
    await conn.execute("CREATE TABLE submissions (job_id text PRIMARY KEY)")
    acknowledged = [f"job-{n:012x}" for n in range(200)]
    for job_id in acknowledged:  # each a transaction of its own, acknowledged before the next
        await conn.execute("INSERT INTO submissions VALUES ($1)", job_id)
    crash(folder)
    conn.terminate()

    start_postgres(folder, port)
    conn = await asyncpg.connect(postgres_url(port, "trainyard"))
    try:
        kept = [row["job_id"] for row in await conn.fetch("SELECT job_id FROM submissions ORDER BY job_id")]
    finally:
        await conn.close()
    assert kept == acknowledged
