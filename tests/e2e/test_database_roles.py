"""The stack's PostgreSQL from a job's side and from the services' (devstack/pglogins.py).

The attack: jobs share the host's network, and the stack's PostgreSQL let anyone in as its superuser without a
password; a job connected and rewrote `scheduler.events`, and after a restart the scheduler showed another
user's job as the attacker's. Now every login needs a password, and each service logs in as its own role."""

from __future__ import annotations

import shlex
import urllib.parse

import asyncpg
import pytest

from devstack.stack import SERVICES
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

# Run by the job, with the agent's Python: try every login a job could guess, over TCP and through the socket,
# and rewrite the scheduler's log with the first that gets in.
ATTACK = """
import asyncio, sys, asyncpg

async def attempt(host, port, database, user, password):
    try:
        conn = await asyncpg.connect(host=host, port=port, database=database, user=user, password=password)
    except Exception as exc:
        return f"refused {user} at {host}: {type(exc).__name__}"
    try:
        await conn.execute("UPDATE scheduler.events SET data = jsonb_set(data, '{creator}', '\\"mallory\\"')")
        return f"REWROTE as {user} at {host}"
    except Exception as exc:
        return f"CONNECTED as {user} at {host}: {type(exc).__name__}"
    finally:
        await conn.close()

async def main(port, database, *hosts):
    results = [await attempt(host, int(port), database, user, password) for host in hosts
               for user in ("postgres", "scheduler", "launcher") for password in (None, "", user)]
    print("\\n".join(results), flush=True)
    sys.exit(0 if all(r.startswith("refused") for r in results) else 3)

asyncio.run(main(*sys.argv[1:]))
"""


def attack(database_url: str) -> JobSpec:
    url = urllib.parse.urlsplit(database_url)
    socket = urllib.parse.unquote(url.hostname or "") if "%2F" in url.netloc.upper() else None
    hosts = ["127.0.0.1", *([socket] if socket else [])]
    arguments = shlex.join([str(url.port or 5432), url.path.lstrip("/"), *hosts])
    return JobSpec(name="guess-the-database", mode="single-node", nodes=1, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="sleeper"), output=OutputRef(name="guess-the-database"),
                   command=f"python3 -c {shlex.quote(ATTACK)} {arguments}")


def short_job(name: str) -> JobSpec:
    """A job that sleeps a tenth of a second and succeeds."""
    return JobSpec(name=name, mode="single-node", nodes=1, flavors=["cpu-1"], algorithm=AlgorithmRef(name="sleeper"),
                   output=OutputRef(name=name), command="python3 run.py --seconds 0.1")


async def test_a_job_cannot_log_in_to_the_stacks_database(stack: Stack, database_url: str) -> None:
    api = await stack.up()
    victim = await api.submit(short_job("victims"))
    assert (await stack.wait_until(victim.job_id, "ended")).status == "succeeded"
    accepted = await api.submit(attack(database_url))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    lines = await stack.logs(accepted.job_id)
    assert job.status == "succeeded", "\n".join(lines)
    assert any("refused postgres at 127.0.0.1" in line for line in lines)
    # After a restart, rebuilt from its log, the scheduler still shows the victim's job as the victim's.
    stack.crash("scheduler")
    stack.start("scheduler")
    await stack.wait_for_nodes()
    assert (await (await stack.api()).get_job(victim.job_id)).job.creator == "tester"


async def test_each_service_does_its_work_as_its_own_role(stack: Stack, database_url: str) -> None:
    api = await stack.up()
    accepted = await api.submit(short_job("as-roles"))
    assert (await stack.wait_until(accepted.job_id, "ended")).status == "succeeded"
    admin = await asyncpg.connect(database_url)
    try:
        logged_in = {row["usename"] for row in await admin.fetch(
            "SELECT usename FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")}
        owners = {(row["schemaname"], row["tableowner"]) for row in await admin.fetch(
            "SELECT schemaname, tableowner FROM pg_tables WHERE schemaname = any($1::text[])", list(SERVICES))}
    finally:
        await admin.close()
    assert logged_in == set(SERVICES)
    # Every table of a service's event log was made by the service, as its role.
    assert {schema for schema, _ in owners} == set(SERVICES)
    assert all(schema == owner for schema, owner in owners)
