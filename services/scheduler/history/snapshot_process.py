"""The live scheduler's snapshots of past states, made in a process of their own.

Making them folds the log into a second state beside the live one (past.py): a process keeps the memory of that
peak for good, though the state is let go (the allocator hands little of it back), so a scheduler that made them
itself grew at each (by 25 to 55 MiB, holding 5,000 jobs). A process of its own gives it all back when it exits, and
folds on the other core rather than beside the event loop of the live one.

The live scheduler starts it when a snapshot is due (`made_apart`), with its own settings and cluster config, and
waits for it; it reads the log and the streams the scheduler follows as the scheduler (its login), writes only the
`past_snapshots` table, and ends. One that fails or takes too long is logged and tried again at the next look: a
snapshot only saves time. One whose code is not the scheduler's (changed on disk since the scheduler started, which
would make snapshots the scheduler cannot read, and drop those it can) makes none.

    python -m services.scheduler.history.snapshot_process --at ISO-INSTANT --every EVENTS  < cluster config (JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from datetime import datetime
from pathlib import Path

import asyncpg
import msgspec

from libs.contracts.cluster import ClusterConfig
from libs.eventstore import EventStore
from libs.messaging.connection import NatsLogin, connect
from libs.settings import Settings
from libs.telemetry.logs import configure_logging, get_logger
from services.scheduler.domain.names import SERVICE
from services.scheduler.history import past
from services.scheduler.history.past_snapshots import FORMAT

log = get_logger(__name__)

_ROOT = Path(__file__).resolve().parents[3]
CODE_CHANGED = 3
TIMEOUT_SECONDS = 1800.0  # a state of 250,000 jobs and 100,000 events after a snapshot: well within a minute


async def made_apart(at: datetime, cluster: ClusterConfig, settings: Settings) -> bool:
    """Have the snapshots up to `at` made by a process of their own; whether it made them."""
    env = {**os.environ, "NATS_URL": settings.nats_url, "DATABASE_URL": settings.database_url}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, "--at", at.isoformat(), "--every", str(past.SNAPSHOT_EVENTS),
        "--format", FORMAT,
        stdin=asyncio.subprocess.PIPE, cwd=_ROOT, env=env)
    try:
        await asyncio.wait_for(process.communicate(msgspec.json.encode(cluster)), TIMEOUT_SECONDS)
    finally:
        if process.returncode is None:  # cancelled (the scheduler stops) or too slow
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        log.warning("scheduler.snapshot_process_failed", code=process.returncode)
    return process.returncode == 0


async def make(at: datetime, cluster: ClusterConfig, settings: Settings) -> bool:
    pool = await asyncpg.create_pool(settings.database_url, password=settings.database_password,
                                     min_size=1, max_size=2)
    try:
        nc = await connect(settings.nats_url, f"trainyard-{SERVICE}-snapshots", NatsLogin.for_service(SERVICE))
        try:
            return await past.PastStates(EventStore(pool, SERVICE), nc.jetstream(), lambda: cluster) \
                .snapshot_if_due(at)
        finally:
            await nc.close()
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Make the scheduler's snapshots of past states up to an instant.")
    parser.add_argument("--at", type=datetime.fromisoformat, required=True, help="the instant of the state made")
    parser.add_argument("--every", type=int, default=past.SNAPSHOT_EVENTS, help="events between two snapshots")
    parser.add_argument("--format", default=FORMAT, help="the snapshots' format the scheduler that asked reads")
    args = parser.parse_args()
    configure_logging(SERVICE)
    if args.format != FORMAT:  # its code changed on disk since it started: snapshots it could not read
        log.warning("scheduler.snapshot_process_skipped", reason="the scheduler's code changed since it started",
                    format=FORMAT, asked=args.format)
        sys.exit(CODE_CHANGED)
    past.SNAPSHOT_EVENTS = args.every  # as the scheduler that asked counts them
    cluster = msgspec.json.decode(sys.stdin.buffer.read(), type=ClusterConfig)
    asyncio.run(make(args.at, cluster, Settings()))


if __name__ == "__main__":
    main()
