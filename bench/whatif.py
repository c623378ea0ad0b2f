"""How fast a what-if replays history (`trainyard simulate`): simulated jobs per second.

    python -m bench.whatif [--jobs 10000] [--nodes 100] [--days 7] [--add cpu-16=10] [--seed 1]

A week of history is made first: jobs of the scheduling benchmark's mix arrive at random over `--days` on
`--nodes` nodes and run 30-100% of their limit (a job without one, an hour), played by the scheduler's own
cycles in virtual time. That history is then replayed as `trainyard simulate` replays the scheduler's log
(`services/scheduler/history/whatif.py`: the same `Simulation`, the report with its waits, use, moved jobs and
series): once with no change, which must start every job when it started, and once with `--add` nodes.
"""

from __future__ import annotations

import argparse
import random
import time
from datetime import datetime, timedelta

from bench.scheduling import FLAVORS, START, build_nodes, random_spec
from libs.contracts.cluster import Resources
from libs.contracts.operations.planning import SimulateHistory, SimulationReport
from libs.placement import NodeCapacity, QueuedJob
from services.scheduler.history.whatif import Recorded, Start, what_if
from services.scheduler.planning.simulation import Arrival, Simulation

UNLIMITED_RUNTIME = 3600


def history(jobs: int, nodes: int, days: float, seed: int) -> tuple[list[NodeCapacity], dict[str, Recorded]]:
    """A history as the scheduler would have made it: arrivals, and what its cycles did with them."""
    rng = random.Random(seed)
    infos = build_nodes(nodes, rng)
    capacity = [NodeCapacity(info=info, free=Resources.of_node(info)) for info in infos]
    arrivals = []
    span = days * 86_400
    for index in range(jobs):
        spec, limit = random_spec(rng, index)
        runtime = int((limit or UNLIMITED_RUNTIME) * rng.uniform(0.3, 1.0))
        at = START + timedelta(seconds=rng.uniform(0, span))
        arrivals.append(Arrival(at, QueuedJob(f"job-{index:012x}", spec, limit or UNLIMITED_RUNTIME), runtime))
    played = Simulation(capacity, FLAVORS, now=START, arrivals=arrivals)
    played.run()
    recorded = {}
    for arrival in arrivals:
        job_id = arrival.job.job_id
        started = played.started.get(job_id)
        recorded[job_id] = Recorded(
            job=arrival.job, submitted_at=arrival.at, started_at=started.at if started else None,
            ended_at=played.ended.get(job_id), status="succeeded" if job_id in played.ended else "queued",
            flavor=FLAVORS[started.flavor] if started else None,
            placement=tuple(started.placement) if started else ())
    return capacity, recorded


def replay(capacity: list[NodeCapacity], recorded: dict[str, Recorded], end: datetime,
           add_nodes: dict[str, int]) -> tuple[SimulationReport, float]:
    start = Start(at=START, nodes=capacity, running=[], queue=[], flavors=FLAVORS)
    request = SimulateHistory(start=START, end=end, add_nodes=add_nodes)
    began = time.perf_counter()
    report = what_if(request, start, end, recorded, [n.info for n in capacity])
    return report, time.perf_counter() - began


def minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:,.0f} min"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--add", default="cpu-16=10", help="FLAVOR=N nodes added in the second replay")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    flavor, _, count = args.add.partition("=")

    began = time.perf_counter()
    capacity, recorded = history(args.jobs, args.nodes, args.days, args.seed)
    print(f"history: {args.jobs:,} jobs over {args.days:g} days on {args.nodes} nodes, made in "
          f"{time.perf_counter() - began:.1f} s")
    end = max(r.ended_at or r.submitted_at for r in recorded.values()) + timedelta(minutes=1)
    for label, added in (("no change", {}), (f"--add-nodes {args.add}", {flavor: int(count)})):
        report, seconds = replay(capacity, recorded, end, added)
        print(f"\n{label}: {seconds:.1f} s, {report.jobs / seconds:,.0f} simulated jobs/s, {report.cycles:,} cycles "
              f"({report.cycles / seconds:,.0f}/s)")
        print(f"  starts: {report.same_start:,} of {report.compared:,} within a second of the history's")
        for waits in report.waits:
            print(f"  {waits.priority:<12} {waits.jobs:>6,} jobs  wait p50 {minutes(waits.real_p50)} -> "
                  f"{minutes(waits.simulated_p50)}, p95 {minutes(waits.real_p95)} -> {minutes(waits.simulated_p95)}")
        print(f"  makespan {minutes(report.makespan_real_seconds)} -> {minutes(report.makespan_simulated_seconds)}")


if __name__ == "__main__":
    main()
