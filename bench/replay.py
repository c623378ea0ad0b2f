"""How fast a service's state is rebuilt from its log: the scheduler's events read from PostgreSQL and
folded into its state, as every start does (and as a view of a past instant does).

    python -m bench.replay [--events 1000000] [--upstream-jobs N]

The scheduler's log is filled with the lives of EVENTS / 4 single-node jobs (JobSubmitted, JobPredicted,
JobAdmitted, JobSucceeded, with their traces), written straight into its events table (COPY) rather than
decided one by one, a millisecond apart; the launcher's events of those jobs (or of some, spread over the history:
`--upstream-jobs`; planned, started, exited, succeeded, recorded between the job's admission and its success) are
published to JetStream, and recorded as reacted to, as before a restart. Then, each timed on its own:

- reading every event (rows → envelopes, the store's `read_all`);
- a start until the scheduler may decide: a real `Scheduler` rebuilt (`EventSourcedService.rebuild`, the first
  step of its `start()`), then its follower of the launcher's events until caught up; with no snapshot yet;
- the snapshots of past states, made as the live scheduler makes them ahead of any view;
- a start from the latest snapshot, and from the one before (the worst case: the most events to fold after it);
- the state at the last instant as `trainyard at` makes it (from the latest snapshot), and at an instant just
  before the latest snapshot (the worst case: from the snapshot before, with the most events to fold after it).

Each with this process's CPU and its peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    JobPredicted,
    JobSubmitted,
    JobSucceeded,
    LaunchPlanned,
    LaunchSucceeded,
    NodeLaunch,
    NodeProcessExited,
    NodeProcessStarted,
    Placement,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.scheduling import Prediction
from libs.contracts.subjects import EVENTS_STREAM, event_subject
from libs.eventstore import EventStore
from libs.eventstore.store import Tracking
from libs.messaging.connection import ensure_streams
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from libs.telemetry.logs import configure_logging
from services.scheduler.domain.names import upstream_consumer
from services.scheduler.history.past import PastStates
from services.scheduler.service import Scheduler

CLUSTER = Path(__file__).resolve().parents[1] / "deploy" / "local" / "cluster.yaml"
EVENTS_PER_JOB = 4
COPY_ROWS = 20_000  # rows per COPY: bounded memory while the log is written
PUBLISH_AHEAD = 2_000  # publications awaiting their acknowledgement at once
TRACE = encode({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}).decode()


def recorded(number: int, step: float, began: datetime) -> datetime:
    """When the `step`th event of job `number`'s life was recorded (the scheduler's are steps 0 to 3; the launcher's
    come between its admission and its success), a millisecond a step."""
    return began + timedelta(milliseconds=EVENTS_PER_JOB * number + step)


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


def launches(jobs: int, of: int, began: datetime) -> Iterator[EventEnvelope]:
    """The launcher's events of `jobs` of the `of` jobs of `job_lives`, spread over them evenly, as its relay
    publishes them."""
    position = 0
    for number in range(0, of, of // jobs)[:jobs]:
        job_id = f"job-{number:012x}"
        node = NodeLaunch(rank=0, node="node-1", address="127.0.0.1", argv=["python3", "train.py", "--epochs", "1"],
                          env={"TRAINYARD_JOB_ID": job_id}, mounts=[])
        life: tuple[Event, ...] = (LaunchPlanned(job_id=job_id, attempt=1, mode="single-node", nodes=[node]),
                                   NodeProcessStarted(job_id=job_id, attempt=1, rank=0, node="node-1", pid=4242),
                                   NodeProcessExited(job_id=job_id, attempt=1, rank=0, node="node-1", exit_code=0),
                                   LaunchSucceeded(job_id=job_id, attempt=1))
        for version, event in enumerate(life, start=1):
            position += 1
            yield EventEnvelope(event_id=str(uuid.uuid4()), service="launcher", aggregate_type="launch",
                                aggregate_id=f"{job_id}.1", version=version, position=position,
                                recorded_at=recorded(number, 2 + version / 5, began), event=event)


async def publish_launches(nats_url: str, store: EventStore, jobs: int, of: int, began: datetime) -> int:
    """Publish the launcher's events of `jobs` jobs, and record that the scheduler reacted to every one (as
    before a restart)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    acks: list[Awaitable[object]] = []
    published = 0
    for envelope in launches(jobs, of, began):
        subject = event_subject("launcher", "launch", type(envelope.event).name())
        acks.append(js.publish(subject, encode(envelope), stream=EVENTS_STREAM))
        if len(acks) == PUBLISH_AHEAD:
            await asyncio.gather(*acks)
            published += len(acks)
            acks.clear()
            print(f"\r  published {published:,} of the launcher's events", end="", flush=True)
    await asyncio.gather(*acks)
    published += len(acks)
    print(f"\r  published {published:,} of the launcher's events")
    last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
    await store.record_tracking(Tracking(upstream_consumer("launcher"), last, published))
    await nc.close()
    return published


async def write_log(pool: asyncpg.Pool, store: EventStore, events: int, began: datetime) -> None:
    rows: list[tuple[object, ...]] = []
    written = 0
    for index, (job_id, version, event) in enumerate(job_lives(events // EVENTS_PER_JOB)):
        rows.append((uuid.uuid4(), "job", job_id, version, str(type(event).__struct_config__.tag),
                     encode(event).decode(), TRACE, recorded(index // EVENTS_PER_JOB, version - 1, began)))
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
                                                  "type", "data", "trace", "recorded_at"])
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
    # A state made is frozen out of the collector, as at a service's start, and a scheduler holds reference cycles:
    # let it go whole, so that the next step runs in a process as a fresh start would (a start is one per process).
    gc.unfreeze()
    gc.collect()


async def read_only(store: EventStore) -> int:
    count = 0
    async for _ in store.read_all():
        count += 1
    return count


async def a_start(store: EventStore, settings: Settings, nats_url: str) -> int:
    """A start, until the scheduler may decide: its own log folded (after the latest snapshot it may take), then the
    launcher's events followed until caught up. How many events its state then holds."""
    runtime = ServiceRuntime("scheduler", settings)
    runtime.store = store
    nc = await nats.connect(nats_url)
    runtime.js = nc.jetstream()
    scheduler = Scheduler.create(runtime)
    began, cpu = time.perf_counter(), time.process_time()
    count = await scheduler.rebuild()  # the first step of every start
    rebuilt, rebuilt_cpu = time.perf_counter() - began, time.process_time() - cpu
    fold = scheduler.fold
    followed = 0

    def counted(envelope: EventEnvelope) -> None:
        nonlocal followed
        followed += 1
        fold(envelope)

    scheduler.fold = counted  # type: ignore[method-assign]
    upstream, = (u for u in scheduler.upstreams() if u.consumer == upstream_consumer("launcher"))
    follower = scheduler.follower(upstream)
    await follower.start()
    await follower.caught_up.wait()
    seconds, cpu_seconds = time.perf_counter() - began - rebuilt, time.process_time() - cpu - rebuilt_cpu
    await follower.stop()
    await nc.close()
    print(f"    {'its own log':<46} {rebuilt:7.1f} s  {count:9,} events  {rebuilt_cpu:38.1f} s CPU")
    print(f"    {'then the launcher followed, until caught up':<46} {seconds:7.1f} s  {followed:9,} events  "
          f"{cpu_seconds:38.1f} s CPU")
    return count + followed


async def without_latest_snapshot(store: EventStore, settings: Settings, nats_url: str) -> int:
    """The worst case of a start: from the snapshot before the latest, with the most events to fold after it (the
    latest is put back after)."""
    table = f"{store.schema}.past_snapshots"
    latest = await store.pool.fetchrow(f"DELETE FROM {table} WHERE at = (SELECT max(at) FROM {table}) RETURNING *")
    assert latest is not None, "snapshots are made before"
    try:
        return await a_start(store, settings, nats_url)
    finally:
        await store.pool.execute(f"INSERT INTO {table} ({', '.join(latest.keys())}) "
                                 f"VALUES ({', '.join(f'${n}' for n in range(1, len(latest) + 1))})", *latest.values())


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
    `SNAPSHOT_EVENTS` events or more to fold after it."""
    when = datetime.now(UTC)
    if before_latest_snapshot:
        when = await store.pool.fetchval(f"SELECT max(at) FROM {store.schema}.past_snapshots") - timedelta(
            microseconds=1)
    async with past_states(store, nats_url) as past, past.at(when) as then:
        return then.events


async def run(events: int, upstream_jobs: int) -> None:
    began = datetime.now(UTC) - timedelta(milliseconds=events + 60_000)  # the whole history in the past
    async with bench_servers("bench_replay") as servers:
        pool = await asyncpg.create_pool(servers.database_url, min_size=1, max_size=2)
        store = EventStore(pool, "scheduler")
        await store.migrate()
        print(f"the scheduler's log: {events:,} events of {events // EVENTS_PER_JOB:,} jobs")
        await write_log(pool, store, events, began)
        await pool.execute("VACUUM ANALYZE scheduler.events")
        jobs = events // EVENTS_PER_JOB
        published = await publish_launches(servers.nats_url, store, upstream_jobs, jobs, began) if upstream_jobs else 0
        held = events + published  # what a start's state holds once it has caught up
        settings = Settings(database_url=servers.database_url, nats_url=servers.nats_url,
                            auth_secret="bench-replay-signing-secret-0123456789abcdef")
        await timed("read (rows to envelopes)", read_only(store), events)
        await timed("a start, with no snapshot", a_start(store, settings, servers.nats_url), held)
        await timed("snapshots made ahead (in the background)", snapshots_ahead(store, servers.nats_url), held)
        await timed("a start from the latest snapshot", a_start(store, settings, servers.nats_url), held)
        await timed("a start from the snapshot before the latest",
                    without_latest_snapshot(store, settings, servers.nats_url), held)
        await timed("a past instant: the log's last", past_state(store, servers.nats_url), held)
        await timed("a past instant: just before the latest snapshot",
                    past_state(store, servers.nats_url, before_latest_snapshot=True))
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--upstream-jobs", type=int, default=None,
                        help="jobs whose launcher events a start follows (default: every job; 0: none)")
    args = parser.parse_args()
    if args.events < EVENTS_PER_JOB:
        parser.error(f"--events must be at least {EVENTS_PER_JOB}")
    jobs = args.events // EVENTS_PER_JOB
    upstream_jobs = jobs if args.upstream_jobs is None else args.upstream_jobs
    if not 0 <= upstream_jobs <= jobs:
        parser.error(f"--upstream-jobs must be between 0 and the jobs of the log ({jobs:,})")
    configure_logging("bench", "warning")
    asyncio.run(run(args.events - args.events % EVENTS_PER_JOB, upstream_jobs))


if __name__ == "__main__":
    main()
