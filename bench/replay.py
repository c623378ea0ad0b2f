"""How fast a service's state is rebuilt from its log: the scheduler's events read from PostgreSQL and
folded into its state, as every start does (and as a view of a past instant would have to).

    python -m bench.replay [--events 1000000]

The scheduler's log is filled with the lives of EVENTS / 4 single-node jobs (JobSubmitted, JobPredicted,
JobAdmitted, JobSucceeded, with their traces), written straight into its events table (COPY) rather than
decided one by one. Then, each timed on its own:

- reading every event (rows → envelopes, the store's `read_all`);
- rebuilding a real `Scheduler` from them (`EventSourcedService.rebuild`, the first step of its `start()`);
- the start snapshots, made as the live scheduler makes them for its next start; a start from the latest, and
  from the one before (the most events to fold after it);
- the snapshots of past states, made as the live scheduler makes them ahead of any view; the state at the last
  instant as `trainyard at` makes it (from the latest snapshot), and at an instant just before the latest
  snapshot (the worst case: from the snapshot before, with the most events to fold after it).

Each with this process's CPU and its peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats

from bench.servers import bench_servers
from libs.contracts.cluster import ClusterConfig
from libs.contracts.codec import encode
from libs.contracts.events import Event, JobAdmitted, JobPredicted, JobSubmitted, JobSucceeded, Placement
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.scheduling import Prediction
from libs.eventstore import EventStore
from libs.messaging.connection import ensure_streams
from libs.runtime import ServiceRuntime
from libs.settings import Settings
from libs.telemetry.logs import configure_logging
from services.scheduler.past import PastStates
from services.scheduler.service import Scheduler
from services.scheduler.start_snapshots import StartSnapshots

CLUSTER = Path(__file__).resolve().parents[1] / "deploy" / "local" / "cluster.yaml"
EVENTS_PER_JOB = 4
COPY_ROWS = 20_000  # rows per COPY: bounded memory while the log is written
TRACE = encode({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}).decode()


def job_lives(jobs: int) -> Iterator[tuple[str, int, Event]]:
    """(job id, version, event) for every event of `jobs` jobs that each ran to success."""
    spec = JobSpec(name="replay", flavors=["cpu-2"], algorithm=AlgorithmRef(name="algo"),
                   output=OutputRef(name="out"), command="python3 train.py --epochs 1")
    placement = [Placement(rank=0, node="node-1", address="127.0.0.1", slots=2)]
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for number in range(jobs):
        job_id = f"job-{number:012x}"
        at = start + timedelta(seconds=number)
        prediction = Prediction(starts_now=True, flavor="cpu-2", nodes=["node-1"], node_count=1,
                                estimated_start=at, latest_start=at, predicted_at=at)
        life: tuple[Event, ...] = (JobSubmitted(job_id=job_id, spec=spec, creator="alice"),
                                   JobPredicted(job_id=job_id, prediction=prediction),
                                   JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-2", placement=placement),
                                   JobSucceeded(job_id=job_id))
        for version, event in enumerate(life, start=1):
            yield job_id, version, event


async def write_log(pool: asyncpg.Pool, store: EventStore, events: int) -> None:
    rows: list[tuple[object, ...]] = []
    written = 0
    for job_id, version, event in job_lives(events // EVENTS_PER_JOB):
        rows.append((uuid.uuid4(), "job", job_id, version, str(type(event).__struct_config__.tag),
                     encode(event).decode(), TRACE))
        if len(rows) == COPY_ROWS:
            written += await _copy(pool, store, rows)
            print(f"\r  written {written:,} events", end="", flush=True)
    written += await _copy(pool, store, rows)
    print(f"\r  written {written:,} events")


async def _copy(pool: asyncpg.Pool, store: EventStore, rows: list[tuple[object, ...]]) -> int:
    count = len(rows)
    if count:
        await pool.copy_records_to_table("events", schema_name=store.schema, records=rows,
                                         columns=["event_id", "aggregate_type", "aggregate_id", "version",
                                                  "type", "data", "trace"])
        rows.clear()
    return count


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def timed(label: str, work: Awaitable[int], events: int | None = None) -> None:
    """`work` timed; it returns how many events the state it made holds (`events`, when given, is checked)."""
    began, cpu = time.perf_counter(), time.process_time()
    count = await work
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    assert events is None or count == events, f"{label}: {count} events read, {events} written"
    print(f"  {label:<48} {seconds:7.1f} s  {count:9,} events  {count / seconds:10,.0f} events/s  "
          f"{cpu_seconds:6.1f} s CPU  peak {peak_mib():,.0f} MiB")


async def read_only(store: EventStore) -> int:
    count = 0
    async for _ in store.read_all():
        count += 1
    return count


async def read_and_fold(store: EventStore, settings: Settings) -> int:
    """A start: the own log folded, from the latest start snapshot when there is one."""
    runtime = ServiceRuntime("scheduler", settings)
    runtime.store = store
    scheduler = Scheduler.create(runtime)
    count = await scheduler.rebuild()  # the first step of every start
    assert len(scheduler.state.jobs) == count // EVENTS_PER_JOB
    return count


async def start_snapshots_ahead(store: EventStore) -> int:
    """What the live scheduler does in the background for its next start: its own log folded, a snapshot every
    `SNAPSHOT_EVENTS` events."""
    starts = StartSnapshots(store)
    assert await starts.make_if_due(ClusterConfig.load(CLUSTER), datetime.now(UTC))
    latest = await starts.latest()
    assert latest is not None
    return latest.events


async def without_latest_start_snapshot(store: EventStore, settings: Settings) -> int:
    """The worst case of a start: from the snapshot before the latest, with the most events to fold after it."""
    await store.pool.execute(f"DELETE FROM {store.schema}.start_snapshots WHERE own_after = "
                             f"(SELECT max(own_after) FROM {store.schema}.start_snapshots)")
    return await read_and_fold(store, settings)


@contextlib.asynccontextmanager
async def past_states(store: EventStore, nats_url: str) -> AsyncIterator[PastStates]:
    """The scheduler's past states, as a scheduler started afresh has them (nothing kept)."""
    nc = await nats.connect(nats_url)
    await ensure_streams(nc.jetstream())
    try:
        yield PastStates(store, nc.jetstream(), lambda: ClusterConfig.load(CLUSTER))
    finally:
        await nc.close()


async def snapshots_ahead(store: EventStore, nats_url: str) -> int:
    """What the live scheduler does in the background once its log has grown: the state of the present made, with
    a snapshot every `SNAPSHOT_EVENTS` events on the way."""
    async with past_states(store, nats_url) as past:
        assert await past.snapshot_if_due(datetime.now(UTC))
        async with past.at(datetime.now(UTC)) as then:  # kept no longer: from the snapshot at the end, nothing folded
            return then.events


async def past_state(store: EventStore, nats_url: str, *, before_latest_snapshot: bool = False) -> int:
    """`trainyard at`: the state at the last instant, rebuilt beside the live one from the latest snapshot before
    it; or at an instant just before the latest snapshot, the worst case: from the one before, with
    `SNAPSHOT_EVENTS` events to fold after it."""
    when = datetime.now(UTC)
    if before_latest_snapshot:
        when = await store.pool.fetchval(f"SELECT max(at) FROM {store.schema}.past_snapshots") - timedelta(
            microseconds=1)
    async with past_states(store, nats_url) as past, past.at(when) as then:
        assert len(then.state.jobs) == -(-then.events // EVENTS_PER_JOB)  # the last job's life may be cut short
        return then.events


async def run(events: int) -> None:
    async with bench_servers("bench_replay") as servers:
        pool = await asyncpg.create_pool(servers.database_url, min_size=1, max_size=2)
        store = EventStore(pool, "scheduler")
        await store.migrate()
        print(f"the scheduler's log: {events:,} events of {events // EVENTS_PER_JOB:,} jobs")
        await write_log(pool, store, events)
        await pool.execute("VACUUM ANALYZE scheduler.events")
        settings = Settings(database_url=servers.database_url, nats_url=servers.nats_url,
                            auth_secret="bench-replay-signing-secret-0123456789abcdef")
        await timed("read (rows to envelopes)", read_only(store), events)
        await timed("read and fold into the scheduler (a start)", read_and_fold(store, settings), events)
        await timed("start snapshots made ahead (in the background)", start_snapshots_ahead(store), events)
        await timed("a start from the latest start snapshot", read_and_fold(store, settings), events)
        await timed("a start from the one before", without_latest_start_snapshot(store, settings), events)
        await timed("snapshots made ahead (in the background)", snapshots_ahead(store, servers.nats_url), events)
        await timed("a past instant: the log's last", past_state(store, servers.nats_url), events)
        await timed("a past instant: just before the latest snapshot",
                    past_state(store, servers.nats_url, before_latest_snapshot=True))
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.events < EVENTS_PER_JOB:
        parser.error(f"--events must be at least {EVENTS_PER_JOB}")
    configure_logging("bench", "warning")
    asyncio.run(run(args.events - args.events % EVENTS_PER_JOB))


if __name__ == "__main__":
    main()
