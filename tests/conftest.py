"""Shared fixtures: real servers for the session, and a clean database and JetStream per test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.js.errors import NotFoundError, ServerError

from agent.ranks.process import end_recorded_jobs
from devstack.provision import Servers, provide_servers
from devstack.servers import create_database
from devstack.stack import local_stack_urls
from libs.contracts import subjects
from libs.messaging.connection import ensure_streams

STORE_NOT_CREATED = 10049  # JetStream's "error creating store for stream"

# pytest-xdist's workers tell their children that the terminal is 80 columns by 24 lines: the CLI sizes its
# tables by COLUMNS when its output is not a terminal, and the tests read its output as a pipe gets it.
for _variable in ("COLUMNS", "LINES"):
    os.environ.pop(_variable, None)


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("NATS_URL") not in (None, "", *local_stack_urls()) and workers > 1:
        # Each test empties the streams of its NATS server: workers sharing one would empty each other's.
        pytest.exit(f"NATS_URL is set and {workers} test workers would share its server: run the tests in one "
                    "worker (`make test WORKERS=0`, pytest -n 0), or unset NATS_URL so each worker starts its own",
                    returncode=4)
    # Postgres runs as an unprivileged user when we are root, so its folder must be reachable.
    with tempfile.TemporaryDirectory(prefix="trainyard-servers-") as workdir:
        Path(workdir).chmod(0o755)
        with provide_servers(Path(workdir)) as found:
            yield found


@pytest_asyncio.fixture(loop_scope="session")
async def database_url(servers: Servers) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    await create_database(servers.postgres_admin_url, name)
    yield servers.database_url(name)
    import asyncpg

    conn = await asyncpg.connect(servers.postgres_admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest_asyncio.fixture(loop_scope="session")
async def nats_url(servers: Servers) -> str:
    """The NATS server, with Trainyard's streams emptied so every test starts from empty logs."""
    nc = await nats.connect(servers.nats_url)
    js = nc.jetstream()
    for stream in (subjects.EVENTS_STREAM, subjects.AGENT_REPORTS_STREAM, subjects.LOGS_STREAM,
                   subjects.CACHE_REPORTS_STREAM, subjects.METRICS_STREAM):
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(stream)
    with contextlib.suppress(NotFoundError):
        await js.delete_key_value(subjects.USAGE_BUCKET)
    # Declared anew, as their owners would: a test may start one service without the owner of a stream it reads.
    # The server removes a deleted stream's files in the background; creating it again meanwhile can fail
    # ("error creating store for stream"), so that is tried again for a while.
    for attempt in range(50):
        try:
            await ensure_streams(js)
            break
        except ServerError as exc:
            if exc.err_code != STORE_NOT_CREATED or attempt == 49:
                raise
            await asyncio.sleep(0.1)
    await nc.close()
    return servers.nats_url


@pytest.fixture(autouse=True)
def _jobs_left_running_are_ended(request: pytest.FixtureRequest) -> Iterator[None]:
    """A stopped agent leaves its jobs running for the next one to adopt: after a test, end what the agents
    under its folder left (as `make down` does), so that no job of one test outlives it."""
    home = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if home is not None:
        for root in [*home.glob("agents/*"), *home.glob("*/agents/*")]:
            if (root / "jobs").is_dir():
                end_recorded_jobs(root, root.name, "the test ended")
