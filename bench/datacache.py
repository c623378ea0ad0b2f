"""Data preparation (SPEC J14, D1, D2): copies side by side, warm starts, and locality.

    python -m bench.datacache [--runs 3] [--datasets 3] [--mib 200] [--stack-runs 3] [--jobs 600]

Part 1 stages the same datasets into a fresh cache three ways, with the agent's own cache code
(agent/caches/datacache.py), alternating the order run after run: one file at a time; each dataset's files side
by side but one dataset after another, as ClearML's loader fetches a dataset's chunks in a thread pool; and
every dataset's files side by side on one pool (data preparation). Every copy is verified (hashed as
read and as written).

Part 2 runs the whole stack and times a job with data preparation from its submit to its process
starting, with its dataset cold (a version never copied) and warm (the same job again on the same node).

Part 3 replays a synthetic workload through the scheduler's own decision (libs/placement.py) on a
homogeneous pool whose nodes each keep the few datasets they read last (LRU), with and without the
locality preference, and counts the rank starts that found their dataset in their node's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec

from agent.caches.datacache import DatasetCache
from bench.servers import bench_servers
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.stack import REPO_ROOT
from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.events import NodeProcessStarted
from libs.contracts.jobspec import AlgorithmRef, DatasetRef, JobSpec, OutputRef
from libs.placement import NodeCapacity, QueuedJob, RunningJob, holdings, schedule

# --- part 1: staging side by side -----------------------------------------------------------------------


def make_datasets(storage: Path, count: int, mib: int, files: int = 2) -> list[str]:
    sources = []
    block = os.urandom(2**20)
    for index in range(count):
        folder = storage / "datasets" / f"set-{index}"
        folder.mkdir(parents=True)
        for part in range(files):
            with (folder / f"part-{part}").open("wb") as out:
                for _ in range(mib // files):
                    out.write(block)
        sources.append(f"datasets/set-{index}")
    return sources


async def stage(storage: Path, sources: list[str], *, workers: int, together: bool) -> float:
    root = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    cache = DatasetCache(root, storage, workers=workers)
    cache.open()
    began = time.perf_counter()
    try:
        if together:
            await asyncio.gather(*(cache.stage(source, lambda _: None, "bench") for source in sources))
        else:
            for source in sources:
                await cache.stage(source, lambda _: None, "bench")
        return time.perf_counter() - began
    finally:
        cache.close()
        shutil.rmtree(root, ignore_errors=True)


async def staging(runs: int, datasets: int, mib: int) -> dict[str, list[float]]:
    storage = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    try:
        sources = make_datasets(storage, datasets, mib)
        ways: dict[str, Callable[[], Awaitable[float]]] = {
            "one file at a time": lambda: stage(storage, sources, workers=1, together=False),
            "a dataset at a time (ClearML)": lambda: stage(storage, sources, workers=4, together=False),
            "side by side (data preparation)": lambda: stage(storage, sources, workers=4, together=True)}
        await ways["one file at a time"]()  # the page cache warmed alike for all
        found: dict[str, list[float]] = {name: [] for name in ways}
        order = list(ways)
        for run in range(runs):
            for name in order if run % 2 == 0 else reversed(order):
                found[name].append(await ways[name]())
            print(f"run {run + 1}: " + ", ".join(f"{name} {found[name][-1]:.2f} s" for name in ways), flush=True)
        return found
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# --- part 2: a job's start, cold and warm -------------------------------------------------------------------


def reader(name: str, dataset: str) -> JobSpec:
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command="true",
                   datasets=[DatasetRef(name=dataset)], data_preparation=True, node_names=["node-a"],
                   output=OutputRef(name=name))


async def start_seconds(api: TrainyardClient, stack: Stack[TrainyardClient], spec: JobSpec) -> float:
    submitted = datetime.now(UTC)
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=300)
    assert job.status == "succeeded", job.reason
    started = next(e.recorded_at for e in await api.events(accepted.job_id) if isinstance(e.event, NodeProcessStarted))
    return (started - submitted).total_seconds()


async def warm_and_cold(runs: int, mib: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"cold": [], "warm": []}
    async with bench_servers("bench_datacache") as servers:
        stack = Stack(servers.home / "stack", None, servers.database_url, connect=TrainyardClient.open,
                      algorithms=REPO_ROOT / "tests" / "e2e" / "algorithms")
        try:
            api = await stack.up()
            for run in range(runs):
                name = f"fresh-{run}"
                make_datasets(stack.storage / "bench", 1, mib, files=4)
                (stack.storage / "bench" / "datasets" / "set-0").rename(stack.storage / "datasets" / name)
                shutil.rmtree(stack.storage / "bench")
                found["cold"].append(await start_seconds(api, stack, reader(f"cold-{run}", name)))
                found["warm"].append(await start_seconds(api, stack, reader(f"warm-{run}", name)))
                print(f"run {run + 1}: cold {found['cold'][-1]:.2f} s, warm {found['warm'][-1]:.2f} s", flush=True)
        finally:
            await stack.close()
    return found


# --- part 3: locality over a replayed workload -------------------------------------------------------------


def replay(jobs: int, *, locality: bool, seed: int = 11, nodes: int = 16, datasets: int = 12,
           kept: int = 3) -> tuple[int, int, float]:
    """(rank starts that found their dataset cached, rank starts, the mean wait in the queue in seconds)."""
    rng = random.Random(seed)
    flavors = {"cpu-4": Flavor(name="cpu-4", cpus=4, memory_mib=8192), "cpu-8": Flavor(name="cpu-8", cpus=8,
                                                                                      memory_mib=16384)}
    infos = [NodeInfo(name=f"n{i:02}", address="10.0.0.1", cpus=8, memory_mib=32768) for i in range(nodes)]
    popularity = [1 / (rank + 1) for rank in range(datasets)]  # a few datasets are read far more often
    base = JobSpec(name="j", flavors=["cpu-4"], algorithm=AlgorithmRef(name="a"), command="true",
                   output=OutputRef(name="o"), data_preparation=True)
    arrivals = []
    clock = datetime(2026, 1, 1, tzinfo=UTC)
    for index in range(jobs):
        clock += timedelta(seconds=rng.expovariate(1 / 90))  # the pool about two thirds busy
        chosen = rng.choices(range(datasets), popularity)[0]
        size = rng.choice([1, 1, 2])
        spec = msgspec.structs.replace(base, flavors=[rng.choice(["cpu-4", "cpu-8"])], nodes=size,
                                       mode="pytorch" if size > 1 else "single-node",
                                       datasets=[DatasetRef(name=f"d{chosen}")])
        arrivals.append((clock, f"job-{index:04}", spec, timedelta(seconds=rng.uniform(300, 1500))))
    caches: dict[str, OrderedDict[str, None]] = {info.name: OrderedDict() for info in infos}
    queue: list[tuple[str, JobSpec, timedelta]] = []
    running: dict[str, RunningJob] = {}
    ends: list[tuple[datetime, str]] = []
    hits = starts = 0
    waited: list[float] = []
    submitted = {job_id: at for at, job_id, _, _ in arrivals}
    now = arrivals[0][0]
    pending = list(arrivals)
    while pending or queue or running:
        upcoming = [t for t in (pending[0][0] if pending else None, ends[0][0] if ends else None) if t is not None]
        if upcoming:
            now = max(now, min(upcoming))
        while pending and pending[0][0] <= now:
            _, job_id, spec, length = pending.pop(0)
            queue.append((job_id, spec, length))
        while ends and ends[0][0] <= now:
            running.pop(heapq.heappop(ends)[1], None)
        used: dict[str, Resources] = {}
        for job in running.values():
            for node, held in holdings(job.placement, job.flavor).items():
                used[node] = used.get(node, Resources()) + held
        capacity = [NodeCapacity(info=info, free=Resources.of_node(info) - used.get(info.name, Resources()))
                    for info in infos]
        waiting = [QueuedJob(job_id, spec, int(length.total_seconds()),
                             prefer={node: 1 for node, kept_sets in caches.items()
                                     if spec.datasets[0].name in kept_sets} if locality else {})
                   for job_id, spec, length in queue]
        decision = schedule(waiting, capacity, flavors, running=list(running.values()), now=now)
        lengths = {job_id: (spec, length) for job_id, spec, length in queue}
        for admission in decision.admissions:
            spec, length = lengths[admission.job_id]
            dataset = spec.datasets[0].name
            for placement in admission.placement:
                starts += 1
                cache = caches[placement.node]
                if dataset in cache:
                    hits += 1
                    cache.move_to_end(dataset)
                else:
                    cache[dataset] = None
                    if len(cache) > kept:
                        cache.popitem(last=False)
            waited.append((now - submitted[admission.job_id]).total_seconds())
            running[admission.job_id] = RunningJob(job_id=admission.job_id, spec=spec, flavor=flavors[admission.flavor],
                                                   placement=admission.placement, ends_at=now + length)
            heapq.heappush(ends, (now + length, admission.job_id))
        started = {a.job_id for a in decision.admissions}
        queue = [item for item in queue if item[0] not in started]
        if not pending and not ends and queue:
            break  # nothing left that would free room
    return hits, starts, statistics.fmean(waited)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--datasets", type=int, default=3)
    parser.add_argument("--mib", type=int, default=200, help="each dataset's size (part 1) and the job's (part 2)")
    parser.add_argument("--stack-runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=600)
    args = parser.parse_args()
    if args.runs:
        found = asyncio.run(staging(args.runs, args.datasets, args.mib))
        print(f"\nstaging {args.datasets} datasets of {args.mib} MiB (2 files each), {args.runs} runs, median "
              f"(min-max):")
        side_by_side = statistics.median(found["side by side (data preparation)"])
        for name, values in found.items():
            ratio = statistics.median(values) / side_by_side
            print(f"  {name:34} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})  "
                  f"x{ratio:.2f} of side by side")
    if args.stack_runs:
        found = asyncio.run(warm_and_cold(args.stack_runs, args.mib))
        print(f"\na job reading one {args.mib} MiB dataset, submit to process start, {args.stack_runs} runs, "
              "median (min-max):")
        for name, values in found.items():
            print(f"  {name:5} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})")
    if args.jobs:
        print(f"\n{args.jobs} jobs replayed on 16 nodes, 12 datasets, 3 kept per node:")
        for locality in (False, True):
            hits, starts, wait = replay(args.jobs, locality=locality)
            print(f"  {'with' if locality else 'without'} locality: {hits} of {starts} rank starts found their "
                  f"dataset cached ({100 * hits / starts:.0f}%), mean wait in the queue {wait:.0f} s")


if __name__ == "__main__":
    main()
