"""The autoscaler: how fast it gives a waiting job instances, and how few it asks for.

    python -m bench.autoscaler [--runs 5] [--burst 200]

Part 1 runs the whole stack with the local provider and an empty pool. Each run submits a 2-node job and
times, from the submit: the autoscaler asking for its instances (InstanceRequested), their agents
registering (InstanceReady), the job running (admitted on them), and, once it ended, the idle instances
released (InstanceReleased, less the type's idle time). Then the next run, on an empty pool again.

Part 2 asks the decision itself (services/autoscaler/scaling.py) for a burst of mixed jobs on an empty
pool, decision after decision as the service makes them while instances boot, until one asks for nothing:
the instances asked for against a lower bound (the burst's CPUs, memory and boards over the largest
instance's), and against counting as ClearML does (an instance per waiting task).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

import msgspec

from bench.servers import bench_servers
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.stack import REPO_ROOT
from libs.contracts.cluster import Accelerators, AutoscalerConfig, Flavor, InstanceNode, InstanceType
from libs.contracts.events import InstanceReady, InstanceReleased, InstanceRequested
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.placement import QueuedJob
from services.autoscaler.scaling import Demand, Nominations, scale_up

IDLE_SECONDS = 2.0
CLUSTER = f"""
flavors:
  - {{name: cpu-1, cpus: 1, memory_mib: 1024}}
autoscaler:
  max_instances: 4
  instance_types:
    - name: small
      provider: local
      node: {{cpus: 1, memory_mib: 2048}}
      flavors: [cpu-1]
      max_instances: 4
      idle_seconds: {IDLE_SECONDS}
"""


async def one_run(api: TrainyardClient, stack: Stack[TrainyardClient], number: int) -> dict[str, float]:
    spec = JobSpec(name=f"grow-{number}", mode="pytorch", nodes=2, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="env-probe"), command="bash -c 'echo rank $RANK'",
                   output=OutputRef(name="grow"))
    seen = {e.event_id async for e in api.autoscaler_log()}
    submitted = datetime.now(UTC)
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    async with asyncio.timeout(60):  # until both instances are released again
        while True:
            new = [e async for e in api.autoscaler_log() if e.event_id not in seen]
            if sum(isinstance(e.event, InstanceReleased) for e in new) == 2:
                break
            await asyncio.sleep(0.2)

    def last(kind: type) -> datetime:
        return max(e.recorded_at for e in new if isinstance(e.event, kind))

    admitted = next(e.recorded_at for e in await api.events(accepted.job_id) if type(e.event).name() == "JobAdmitted")
    ended = job.ended_at or last(InstanceReleased)
    return {"requested": seconds(last(InstanceRequested) - submitted),
            "ready": seconds(last(InstanceReady) - submitted), "running": seconds(admitted - submitted),
            "released": seconds(last(InstanceReleased) - ended) - IDLE_SECONDS}


def seconds(delta: timedelta) -> float:
    return delta.total_seconds()


async def stack_runs(runs: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    async with bench_servers("bench_autoscaler") as servers:
        cluster = servers.home / "cluster.yaml"
        cluster.write_text(CLUSTER)
        stack = Stack(servers.home / "stack", None, servers.database_url, connect=TrainyardClient.open,
                      cluster=cluster, algorithms=REPO_ROOT / "tests" / "e2e" / "algorithms")
        try:
            api = await stack.up()
            for number in range(1, runs + 1):
                times = await one_run(api, stack, number)
                print(f"run {number}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
                for key, value in times.items():
                    found.setdefault(key, []).append(value)
        finally:
            await stack.close()
    return found


def burst_decision(count: int, seed: int = 7) -> None:
    flavors = {f.name: f for f in (Flavor(name="cpu-1", cpus=1, memory_mib=2048),
                                   Flavor(name="cpu-4", cpus=4, memory_mib=8192),
                                   Flavor(name="gpu-1", cpus=4, memory_mib=16384, accelerators=1, board="a100"))}
    types = [InstanceType(name="cpu-small", provider="local", node=InstanceNode(cpus=4, memory_mib=16384),
                          flavors=["cpu-1", "cpu-4"], max_instances=500),
             InstanceType(name="cpu-big", provider="local", node=InstanceNode(cpus=16, memory_mib=65536),
                          flavors=["cpu-1", "cpu-4"], max_instances=500),
             InstanceType(name="gpu", provider="local", flavors=["gpu-1"], max_instances=500,
                          node=InstanceNode(cpus=16, memory_mib=65536, accelerators=[Accelerators(board="a100",
                                                                                                 count=4)]))]
    rng = random.Random(seed)
    base = JobSpec(name="j", flavors=["cpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
                   output=OutputRef(name="o"))
    queue = []
    for index in range(count):
        flavor = rng.choice(["cpu-1", "cpu-1", "cpu-4", "gpu-1"])
        nodes = rng.choice([1, 1, 1, 2, 4])
        queue.append(QueuedJob(f"job-{index:04}", msgspec.structs.replace(
            base, flavors=[flavor], nodes=nodes, mode="pytorch" if nodes > 1 else "single-node")))
    # Decisions one after another, each counting the instances asked for before as on their way, as the
    # service makes them while instances boot, until one asks for nothing more.
    config = AutoscalerConfig(max_instances=1000, instance_types=types)
    on_the_way: dict[str, str] = {}
    promised: dict[str, list[str]] = {}
    nominated: Nominations = {}
    timings: list[float] = []
    while True:
        began = time.perf_counter()
        alive = {kind.name: sum(t == kind.name for t in on_the_way.values()) for kind in types}
        decided = scale_up(Demand(queue=queue, nodes=[], flavors=flavors), config, on_the_way=on_the_way,
                           promised=promised, nominated=nominated, alive=alive, cooling=(),
                           suffixes=[f"{len(timings)}x{i:05x}" for i in range(64)], now=datetime.now(UTC))
        timings.append(time.perf_counter() - began)
        if not decided.requests:
            break
        on_the_way.update({r.instance: r.instance_type for r in decided.requests})
        promised.update({r.instance: r.jobs for r in decided.requests})
        nominated = decided.nominations
    by_type = {kind.name: sum(t == kind.name for t in on_the_way.values()) for kind in types}
    need = {name: sum(getattr(flavors[j.spec.flavors[0]], name) * j.spec.nodes for j in queue)
            for name in ("cpus", "memory_mib", "accelerators")}
    # No instance offers more than 16 CPUs, 64 GiB or 4 boards: the burst needs at least this many.
    bound = max(math.ceil(need["cpus"] / 16), math.ceil(need["memory_mib"] / 65536),
                math.ceil(need["accelerators"] / 4))
    ranks = sum(j.spec.nodes for j in queue)
    print(f"\nburst of {count} jobs ({ranks} ranks; {need['cpus']:g} CPUs, {need['accelerators']} boards) on an empty "
          f"pool: {len(timings) - 1} decision(s) asked for instances, each in at most {max(timings):.2f} s, "
          f"and the next asked for none")
    print(f"  instances asked for: {len(on_the_way)} ({', '.join(f'{k} {v}' for k, v in by_type.items())})")
    print(f"  lower bound: {bound} (the burst's CPUs, memory and boards over the largest instance's)")
    print(f"  counting tasks as ClearML does: {count} instances (one per queued task)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--burst", type=int, default=200)
    args = parser.parse_args()
    if args.runs:
        found = asyncio.run(stack_runs(args.runs))
        print(f"\nlocal provider, {args.runs} runs, median (min-max) from submit:")
        for key, values in found.items():
            print(f"  {key:9} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})")
    burst_decision(args.burst)


if __name__ == "__main__":
    main()
