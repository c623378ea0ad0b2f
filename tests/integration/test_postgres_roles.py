"""Each service logs in to PostgreSQL as a role of its own, owning its schema alone (devstack/pglogins.py).

The attack they close: a job on the host connected to the stack's PostgreSQL and rewrote `scheduler.events`;
after a restart the scheduler showed another user's job as the attacker's. Without a password no one connects
(tests/integration/test_devstack_postgres.py); with a service's own password, only that service's schema is
within reach."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
import yaml

from devstack.pglogins import database_login_env, provision_service_logins
from devstack.servers import admin_url, create_database, postgres_bin_dir, postgres_url
from devstack.stack import REPO_ROOT, SERVICES, ProcessSet, provision_auth, stack_env, start_agent
from libs.eventstore import EventStore
from tests.support.postgres import private_postgres, server_folder


@pytest.fixture
def server() -> Iterator[tuple[Path, int]]:
    with server_folder() as home, private_postgres(home) as found:
        yield found


@pytest_asyncio.fixture(loop_scope="session")
async def stack_home(server: tuple[Path, int], tmp_path: Path) -> Path:
    """The roles of a stack whose state folder is `tmp_path`, on database `trainyard`, as `make up` makes them."""
    folder, port = server
    await create_database(admin_url(folder, port, "postgres"), "trainyard")
    provision_service_logins(tmp_path, SERVICES, postgres_url(port, "trainyard", socket_dir=folder),
                             admin_url=admin_url(folder, port, "trainyard"))
    return tmp_path


async def connect_as(home: Path, service: str) -> asyncpg.Connection:
    """A connection as the service itself makes it: the URL and password file it is handed."""
    env = database_login_env(home, service)
    return await asyncpg.connect(env["DATABASE_URL"], password=Path(env["TRAINYARD_DATABASE_PASSWORD_FILE"])
                                 .read_text().strip())


@pytest_asyncio.fixture(loop_scope="session")
async def scheduler_log(stack_home: Path) -> AsyncIterator[Path]:
    """The scheduler's event log, made by the scheduler's role, with one event in it."""
    env = database_login_env(stack_home, "scheduler")
    pool = await asyncpg.create_pool(env["DATABASE_URL"], min_size=1, max_size=1,
                                     password=Path(env["TRAINYARD_DATABASE_PASSWORD_FILE"]).read_text().strip())
    try:
        await EventStore(pool, "scheduler").migrate()
        await pool.execute("INSERT INTO scheduler.events (event_id, aggregate_type, aggregate_id, version, type, data)"
                           " VALUES ($1, 'job', 'job-1', 1, 'JobSubmitted', '{\"creator\": \"alice\"}')", uuid.uuid4())
    finally:
        await pool.close()
    yield stack_home


async def test_the_launchers_role_can_neither_read_nor_rewrite_the_schedulers_event_log(scheduler_log: Path) -> None:
    launcher = await connect_as(scheduler_log, "launcher")
    try:
        assert await launcher.fetchval("SELECT current_user") == "launcher"
        for statement in ("SELECT * FROM scheduler.events",
                          "UPDATE scheduler.events SET data = '{\"creator\": \"mallory\"}'",
                          "INSERT INTO scheduler.events (event_id, aggregate_type, aggregate_id, version, type, data) "
                          "VALUES (gen_random_uuid(), 'job', 'job-2', 1, 'JobSubmitted', '{}')",
                          "DELETE FROM scheduler.events",
                          "CREATE TABLE scheduler.planted (x int)",
                          "DROP SCHEMA scheduler CASCADE",
                          "SET ROLE scheduler",
                          "SET ROLE postgres",
                          "ALTER ROLE launcher SUPERUSER",
                          "CREATE ROLE mallory LOGIN",
                          "CREATE TABLE public.planted (x int)"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await launcher.execute(statement)
    finally:
        await launcher.close()
    # The log is as the scheduler wrote it.
    scheduler = await connect_as(scheduler_log, "scheduler")
    try:
        rows = await scheduler.fetch("SELECT aggregate_id, data FROM scheduler.events")
    finally:
        await scheduler.close()
    assert [(row["aggregate_id"], json.loads(row["data"])) for row in rows] == [("job-1", {"creator": "alice"})]


async def test_each_service_keeps_its_own_event_log_as_its_own_role(stack_home: Path,
                                                                    server: tuple[Path, int]) -> None:
    for service in SERVICES:
        env = database_login_env(stack_home, service)
        pool = await asyncpg.create_pool(env["DATABASE_URL"], min_size=1, max_size=1,
                                         password=Path(env["TRAINYARD_DATABASE_PASSWORD_FILE"]).read_text().strip())
        try:
            await EventStore(pool, service).migrate()
            await EventStore(pool, service).migrate()  # again, as every start does
        finally:
            await pool.close()
    folder, port = server
    admin = await asyncpg.connect(admin_url(folder, port, "trainyard"))
    try:
        owners = {row["nspname"]: row["owner"] for row in await admin.fetch(
            "SELECT nspname, nspowner::regrole::text AS owner FROM pg_namespace WHERE nspname = any($1::text[])",
            list(SERVICES))}
        tables = {(row["schemaname"], row["tableowner"]) for row in await admin.fetch(
            "SELECT schemaname, tableowner FROM pg_tables WHERE schemaname = any($1::text[])", list(SERVICES))}
    finally:
        await admin.close()
    assert owners == {service: service for service in SERVICES}
    assert tables == {(service, service) for service in SERVICES}


async def test_provisioning_again_keeps_the_passwords_and_grants_nothing_more(
        stack_home: Path, server: tuple[Path, int]) -> None:
    folder, port = server
    passwords = {service: (stack_home / "postgres-auth" / f"{service}.password").read_text() for service in SERVICES}
    assert stat.S_IMODE((stack_home / "postgres-auth").stat().st_mode) == 0o700
    for service in SERVICES:
        assert stat.S_IMODE((stack_home / "postgres-auth" / f"{service}.password").stat().st_mode) == 0o600
    # As the next `make up` does.
    provision_service_logins(stack_home, SERVICES, postgres_url(port, "trainyard", socket_dir=folder),
                             admin_url=admin_url(folder, port, "trainyard"))
    assert passwords == {service: (stack_home / "postgres-auth" / f"{service}.password").read_text()
                         for service in SERVICES}
    for service in SERVICES:
        await (await connect_as(stack_home, service)).close()
    admin = await asyncpg.connect(admin_url(folder, port, "trainyard"))
    try:
        roles = await admin.fetch("SELECT rolname, rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
                                  "FROM pg_roles WHERE rolname = any($1::text[])", list(SERVICES))
        # Any other login of the server, such as one made for something else, may not even connect to the database.
        await admin.execute("CREATE ROLE bystander LOGIN PASSWORD 'bystander'")
    finally:
        await admin.close()
    assert sorted(row["rolname"] for row in roles) == sorted(SERVICES)
    assert not any(any(value for key, value in row.items() if key != "rolname") for row in roles)
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await asyncpg.connect(postgres_url(port, "trainyard", user="bystander", password="bystander"))


async def test_node_agents_get_no_database_url_or_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Even one the operator's environment holds: `DATABASE_URL=... make up` on a server of their own.
    operators = "postgresql://trainyard:secret@db.example/trainyard"
    monkeypatch.setenv("DATABASE_URL", operators)
    monkeypatch.setenv("PGPASSWORD", "secret")
    provision_service_logins(tmp_path, SERVICES, operators, admin_url=None)
    assert {service: database_login_env(tmp_path, service) for service in SERVICES} == {
        service: {"DATABASE_URL": operators} for service in SERVICES}
    env = stack_env(nats_url="nats://127.0.0.1:1", storage=tmp_path / "storage", cluster=tmp_path / "cluster.yaml",
                    extra=provision_auth(tmp_path))
    processes = ProcessSet(tmp_path, env)
    # What runs in the agent's place shows the environment it was given.
    show = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    start_agent(processes, "node-a", tmp_path / "cluster.yaml", tmp_path / "agents", host=show)
    processes.processes["agent-node-a"].wait(timeout=60)
    agent = json.loads(processes.log("agent-node-a"))
    assert not {"DATABASE_URL", "TRAINYARD_DATABASE_PASSWORD_FILE", "PGPASSWORD"} & set(agent)
    assert not [value for value in agent.values() if "secret@" in value or "postgres-auth" in value]
    assert agent["NATS_URL"] == "nats://127.0.0.1:1"  # what it does get


async def test_the_kubernetes_job_makes_the_same_roles(server: tuple[Path, int], tmp_path: Path) -> None:
    """deploy/k8s/database-roles.yaml runs database-roles.sql with psql: run its command here, twice (it is run again
    after a change of a password), on a database where the services all wrote as one user before."""
    folder, port = server
    await create_database(admin_url(folder, port, "postgres"), "trainyard")
    earlier = await asyncpg.create_pool(admin_url(folder, port, "trainyard"), min_size=1, max_size=1)
    try:
        await EventStore(earlier, "scheduler").migrate()
    finally:
        await earlier.close()
    [job] = yaml.safe_load_all((REPO_ROOT / "deploy" / "k8s" / "database-roles.yaml").read_text())
    [container] = job["spec"]["template"]["spec"]["containers"]
    command = [part.replace("/etc/trainyard-database/", f"{REPO_ROOT}/deploy/k8s/") for part in container["command"]]
    passwords = {service: f"{service}-{uuid.uuid4().hex}" for service in SERVICES}
    env = {"PATH": f"{postgres_bin_dir()}:/usr/bin:/bin", "ADMIN_URL": admin_url(folder, port, "trainyard"),
           **{f"{service.upper()}_PASSWORD": password for service, password in passwords.items()}}
    for _ in range(2):
        await asyncio.to_thread(subprocess.run, command, env=env, check=True, capture_output=True)
    launcher = await asyncpg.connect(postgres_url(port, "trainyard", user="launcher", password=passwords["launcher"]))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await launcher.fetch("SELECT * FROM scheduler.events")
    finally:
        await launcher.close()
    # The scheduler's role took over its log, and keeps it as its own.
    pool = await asyncpg.create_pool(postgres_url(port, "trainyard", user="scheduler", password=passwords["scheduler"]),
                                     min_size=1, max_size=1)
    try:
        await EventStore(pool, "scheduler").migrate()
        assert await pool.fetchval("SELECT tableowner FROM pg_tables WHERE schemaname = 'scheduler' "
                                   "AND tablename = 'events'") == "scheduler"
    finally:
        await pool.close()
