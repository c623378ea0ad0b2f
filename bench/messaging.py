"""What the event machinery costs a service's process: CPU per event the outbox relay publishes, per event
a follower folds and per event it tracks, on the tests' servers (NATS with `sync_interval: always`).

    python -m bench.messaging [--jobs 1000] [--per-append 1,16]

A scheduler's log of JOBS jobs (JobSubmitted, JobAdmitted and JobSucceeded each, with their traces) is
published by `OutboxRelay` as the service's relay does, then replayed from the stream by a `StreamFollower`
that folds each event into a `JobLifecycle`, and by one that also tracks each (a reaction that records
nothing, its position written later, as most upstream messages are). Each count of `--per-append` records the
log anew with that many jobs' events of a kind in one append (1: each event alone, in a message of its own; more:
the relay publishes them as bundles). CPU is this process's, so the servers' share is not in it; the whole stack's
is in `bench.throughput --cpu`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.aio.msg import Msg

from devstack.provision import Servers, provide_servers
from devstack.servers import create_database
from libs.contracts import subjects
from libs.contracts.events import Event, EventEnvelope, JobAdmitted, JobSubmitted, JobSucceeded, Placement
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.eventstore import EventStore, NewEvent, OutboxRelay, Tracking
from libs.jobstatus import JobLifecycle
from libs.messaging.connection import ensure_streams
from libs.messaging.follower import StreamFollower
from libs.telemetry.logs import configure_logging
from libs.telemetry.tracing import configure_tracing, current_trace_headers, tracer

EVENTS_PER_JOB = 3


async def cpu_per_item(work: Awaitable[Any], items: int) -> float:
    """Microseconds of this process's CPU per item while `work` runs."""
    began = time.process_time()
    await work
    return (time.process_time() - began) / items * 1e6


async def record_jobs(store: EventStore, jobs: int, per_append: int) -> None:
    spec = JobSpec(name="bench", flavors=["cpu-1"], algorithm=AlgorithmRef(name="sleeper"),
                   output=OutputRef(name="bench"), command="python3 run.py --seconds 1")
    placement = [Placement(rank=0, node="node-1", address="127.0.0.1", slots=1)]
    submitting = tracer("bench.messaging")
    for first in range(0, jobs, per_append):
        job_ids = [f"job-{number:012x}" for number in range(first, min(first + per_append, jobs))]
        traces = {}
        for job_id in job_ids:
            with submitting.start_as_current_span("submit"):  # each job's events carry its trace, as in the stack
                traces[job_id] = current_trace_headers()
        lives: dict[str, tuple[Event, ...]] = {
            job_id: (JobSubmitted(job_id=job_id, spec=spec, creator="alice"),
                     JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=placement),
                     JobSucceeded(job_id=job_id)) for job_id in job_ids}
        for version in range(EVENTS_PER_JOB):
            await store.append([NewEvent("job", job_id, lives[job_id][version], trace=traces[job_id])
                                for job_id in job_ids],
                               expected_versions={("job", job_id): version for job_id in job_ids})


async def publish_all(relay: OutboxRelay) -> None:
    while await relay.publish_pending():
        pass


async def follow_all(follower: StreamFollower) -> None:
    await follower.start()
    await follower.caught_up.wait()
    await follower.stop()


async def run(servers: Servers, jobs: int, per_append: int) -> None:
    name = f"bench_messaging_{uuid.uuid4().hex[:8]}"
    await create_database(servers.postgres_admin_url, name)
    pool = await asyncpg.create_pool(servers.database_url(name), min_size=2, max_size=8)
    nc = await nats.connect(servers.nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    await js.purge_stream(subjects.EVENTS_STREAM)  # the last count's log
    scheduler, follower_store = EventStore(pool, "scheduler"), EventStore(pool, "launcher")
    for store in (scheduler, follower_store):
        await store.migrate()
    await record_jobs(scheduler, jobs, per_append)
    events = jobs * EVENTS_PER_JOB

    print(f"{per_append} job(s) a kind of event in each append")
    relay = await cpu_per_item(publish_all(OutboxRelay(scheduler, js)), events)
    messages = (await js.stream_info(subjects.EVENTS_STREAM)).state.messages
    print(f"  outbox relay, per event published          {relay:7.1f} µs  ({events} events in {messages} messages)")

    async def fold(message: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        lifecycle.apply(message)
        return False  # tracked messages had no reaction: their positions are written later

    for tracked in (False, True):
        lifecycle = JobLifecycle()
        follower = StreamFollower(js, follower_store, stream=subjects.EVENTS_STREAM,
                                  subject=subjects.events_of("scheduler", "job"),
                                  consumer=f"bench-{uuid.uuid4().hex[:6]}", message_type=EventEnvelope,
                                  handle=fold, reactions=tracked)
        cost = await cpu_per_item(follow_all(follower), events)
        print(f"  follower, per event {'folded and tracked' if tracked else 'folded':<22} {cost:7.1f} µs")
    await nc.close()
    await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--per-append", default="1,16", help="jobs' events of a kind in one append, each in turn")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    configure_tracing("bench")
    with tempfile.TemporaryDirectory(prefix="bench-messaging-") as folder:
        Path(folder).chmod(0o755)  # PostgreSQL runs as another user when started as root
        with provide_servers(Path(folder)) as servers:
            for per_append in (int(count) for count in args.per_append.split(",")):
                asyncio.run(run(servers, args.jobs, per_append))


if __name__ == "__main__":
    main()
