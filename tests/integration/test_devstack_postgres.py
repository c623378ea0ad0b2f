"""The local stack's PostgreSQL (the tests' own too): nothing connects to it without a password, and it keeps
what it acknowledged through a crash of PostgreSQL itself: a commit returns once its WAL is with the OS
(synchronous_commit on), even though it does not fsync. Its processes reach it through its Unix socket."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from devstack.provision import Servers
from devstack.servers import admin_url, create_database, free_port, postgres_url, start_postgres, stop_postgres
from tests.support.postgres import crash_postgres, private_postgres, server_folder, trusting_postgres


@pytest.fixture
def postgres() -> Iterator[tuple[Path, int]]:
    with server_folder() as home, private_postgres(home) as server:
        yield server


async def test_acknowledged_commits_survive_a_crash_of_postgres(postgres: tuple[Path, int]) -> None:
    folder, port = postgres
    await create_database(admin_url(folder, port, "postgres", socket=False), "trainyard")
    conn = await asyncpg.connect(admin_url(folder, port, "trainyard", socket=False))
    await conn.execute("CREATE TABLE submissions (job_id text PRIMARY KEY)")
    acknowledged = [f"job-{n:012x}" for n in range(200)]
    for job_id in acknowledged:  # each a transaction of its own, acknowledged before the next
        await conn.execute("INSERT INTO submissions VALUES ($1)", job_id)
    crash_postgres(folder)
    conn.terminate()

    start_postgres(folder, port)
    conn = await asyncpg.connect(admin_url(folder, port, "trainyard", socket=False))
    try:
        kept = [row["job_id"] for row in await conn.fetch("SELECT job_id FROM submissions ORDER BY job_id")]
    finally:
        await conn.close()
    assert kept == acknowledged


async def test_the_stacks_processes_reach_it_through_its_unix_socket(postgres: tuple[Path, int]) -> None:
    folder, port = postgres
    url = admin_url(folder, port, "postgres")
    # Servers.database_url names another database on the same server, through the same socket.
    assert Servers("nats://unused", url).database_url("trainyard") == admin_url(folder, port, "trainyard")
    await create_database(url, "trainyard")
    conn = await asyncpg.connect(admin_url(folder, port, "trainyard"))
    try:
        # No server address: the connection is not over TCP.
        assert await conn.fetchval("SELECT inet_server_addr()") is None
        assert await conn.fetchval("SELECT current_database()") == "trainyard"
    finally:
        await conn.close()
    tcp = await asyncpg.connect(admin_url(folder, port, "trainyard", socket=False))
    try:
        assert str(await tcp.fetchval("SELECT inet_server_addr()")) == "127.0.0.1"
    finally:
        await tcp.close()


async def refused(url: str, password: str | None = None) -> bool:
    try:
        conn = await asyncpg.connect(url, password=password)
    except asyncpg.InvalidAuthorizationSpecificationError:  # wrong or missing password
        return True
    await conn.close()
    return False


async def test_no_one_connects_without_the_password_not_even_as_the_administrator(
        postgres: tuple[Path, int]) -> None:
    # The attack: a job on the host connected as the superuser, without a password, and rewrote an event log.
    folder, port = postgres
    for socket_dir in (None, folder):  # over TCP and through the socket
        assert await refused(postgres_url(port, "postgres", socket_dir=socket_dir))
        assert await refused(postgres_url(port, "postgres", socket_dir=socket_dir), password="postgres")
        assert not await refused(admin_url(folder, port, "postgres", socket=socket_dir is not None))
    # The administrator's password is the state folder's alone to read.
    secrets = folder.parent / "postgres-auth"  # in the state folder, beside the server's
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert stat.S_IMODE((secrets / "postgres.password").stat().st_mode) == 0o600
    conn = await asyncpg.connect(admin_url(folder, port, "postgres"))
    try:
        rules = await conn.fetch("SELECT type, auth_method FROM pg_hba_file_rules")
        assert await conn.fetchval("SHOW password_encryption") == "scram-sha-256"
        assert (await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")).startswith(
            "SCRAM-SHA-256$")
    finally:
        await conn.close()
    assert {row["auth_method"] for row in rules} == {"scram-sha-256"}
    assert {row["type"] for row in rules} == {"local", "host"}


async def test_a_cluster_an_earlier_stack_made_trusting_everyone_is_converted_keeping_its_data() -> None:
    with server_folder() as home:
        await convert_a_trusting_cluster(home / "postgres", free_port())


async def convert_a_trusting_cluster(folder: Path, port: int) -> None:
    with trusting_postgres(folder, port) as trusted:
        await create_database(trusted, "trainyard")
        conn = await asyncpg.connect(postgres_url(port, "trainyard"))  # no password: all are trusted
        await conn.execute("CREATE TABLE kept (job_id text PRIMARY KEY); INSERT INTO kept VALUES ('job-1')")
        await conn.close()
    start_postgres(folder, port)  # as the next `make up` does
    try:
        assert await refused(postgres_url(port, "trainyard"))
        assert await refused(postgres_url(port, "trainyard", socket_dir=folder))
        conn = await asyncpg.connect(admin_url(folder, port, "trainyard"))
        try:
            assert await conn.fetchval("SELECT job_id FROM kept") == "job-1"
        finally:
            await conn.close()
    finally:
        stop_postgres(folder)
