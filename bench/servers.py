"""NATS and PostgreSQL for a benchmark that runs whole processes: the tests' servers, in a folder of its own."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from devstack.provision import provide_servers
from devstack.servers import create_database


@dataclass(frozen=True)
class BenchServers:
    home: Path  # a temporary folder for the benchmark's own files, removed at the end
    nats_url: str
    database_url: str


@contextlib.asynccontextmanager
async def bench_servers(name: str) -> AsyncIterator[BenchServers]:
    """Servers as the tests get them (started here when the machine has none), with a new database `name`."""
    with tempfile.TemporaryDirectory(prefix=f"trainyard-{name}-") as workdir:
        home = Path(workdir)
        home.chmod(0o755)  # PostgreSQL runs as another user when started as root
        with provide_servers(home / "servers") as servers:
            await create_database(servers.postgres_admin_url, name)
            yield BenchServers(home, servers.nats_url, servers.database_url(name))
