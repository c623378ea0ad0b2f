"""How good queue predictions are: a seeded workload replayed in virtual time.

    python -m bench.prediction_accuracy [--jobs 1500] [--nodes 100] [--load 0.9] [--unlimited 0.1]
                                        [--runtime 0.3 1.0] [--users 8] [--habits] [--seed 1]

Jobs arrive at random, submitted by a few users; each has a duration limit and really runs for
30-100% of it, except a share (`--unlimited`, one in ten by default) that has no limit and runs 1-8
hours. With `--habits` each user runs jobs for their own share of the limit instead (from 10-30% for
one user up to 80-100% for another). At every arrival the job is predicted (S6), then the scheduler
runs a cycle, as it does at every arrival and completion; each job that ends teaches the runtime
model. Predicted and actual starts are compared for two estimates: the latest start (every job runs
to its limit, the estimate before the runtime model) and the likely start (runtimes from the model).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import platform
import random
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from bench.scheduling import FLAVORS, START, build_nodes, p95, random_spec
from libs.contracts.cluster import Resources
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec
from libs.placement import NodeCapacity, QueuedJob, RunningJob, holdings, schedule
from services.scheduler.planning import playthrough
from services.scheduler.planning.prediction import ROUGH, Forecast, forecast
from services.scheduler.planning.runtime_model import RuntimeModel, expected_runtimes


@dataclass
class Job:
    job_id: str
    spec: JobSpec
    creator: str
    arrival: datetime
    limit: int | None
    runtime: int
    forecast: Forecast | None = None
    started: datetime | None = None
    flavor: str | None = None
    backfilled: bool = False  # started ahead of a job waiting before it

    # What the runtime model reads of a job.
    @property
    def started_at(self) -> datetime | None:
        return self.started

    @property
    def ended_at(self) -> datetime | None:
        return self.started + timedelta(seconds=self.runtime) if self.started else None

    @property
    def duration_seconds(self) -> int | None:
        return self.limit


def workload(count: int, nodes: int, load: float, unlimited: float, rng: random.Random,
             runtime: tuple[float, float] = (0.3, 1.0), users: int = 8, habits: bool = False,
             who: random.Random | None = None) -> list[Job]:
    """Arrivals spaced so that the demand is about `load` times the cluster's CPUs; a share
    `unlimited` of the jobs has no duration limit; the others run for a share of their limit drawn
    uniformly from `runtime`, or with `habits` from their user's own range. Users are drawn from
    `who`, so that they leave the rest of the workload as it was without them."""
    who = who or random.Random(0)
    jobs: list[Job] = []
    for index in range(count):
        spec, _ = random_spec(rng, index)
        user = who.randrange(users)
        share = runtime
        if habits:  # user 0 runs 10-30% of the limit, the last one 80-100%
            low = 0.1 + 0.7 * user / max(users - 1, 1)
            share = (low, low + 0.2)
        limit = rng.choice([900, 1800, 3600, 7200, 14_400, 28_800]) if rng.random() >= unlimited else None
        actual = int(limit * rng.uniform(*share)) if limit else rng.randint(3600, 28_800)
        jobs.append(Job(job_id=f"job-{index:06}", spec=spec, creator=f"user-{user}", arrival=START, limit=limit,
                        runtime=actual))
    # Mean demand per job in CPU-seconds against the cluster's (roughly 80 CPUs per node).
    demand = statistics.mean(j.runtime * j.spec.nodes * min(FLAVORS[f].cpus for f in j.spec.flavors) for j in jobs)
    gap = demand / (nodes * 80 * load)
    clock = START
    for job in jobs:
        clock += timedelta(seconds=rng.expovariate(1 / gap))
        job.arrival = clock
    return jobs


def replay(jobs: list[Job], node_count: int, rng: random.Random) -> float:
    """Run the workload; fill in each job's forecast and start. Returns seconds spent deciding."""
    infos = build_nodes(node_count, rng)
    free = {n.name: Resources.of_node(n) for n in infos}
    by_id = {job.job_id: job for job in jobs}
    queue: list[QueuedJob] = []
    order: list[tuple[int, int]] = []  # (priority rank, arrival index) of each queued job, kept sorted
    running: dict[str, RunningJob] = {}
    completions: list[tuple[datetime, str]] = []
    model = RuntimeModel()
    arrivals = list(enumerate(jobs))
    spent = 0.0
    while arrivals or completions:
        if arrivals and (not completions or arrivals[0][1].arrival <= completions[0][0]):
            now = arrivals[0][1].arrival
        else:
            now = completions[0][0]
        while completions and completions[0][0] <= now:
            _, job_id = heapq.heappop(completions)
            ended = running.pop(job_id)
            for name, amount in holdings(ended.placement, ended.flavor).items():
                free[name] = free[name] + amount
            model.job_ended(by_id[job_id])
        nodes = [NodeCapacity(info=info, free=free[info.name]) for info in infos]
        began = time.perf_counter()
        while arrivals and arrivals[0][1].arrival <= now:
            index, job = arrivals.pop(0)
            holders = list(running.values())
            job.forecast = forecast(job.spec, queue, nodes, FLAVORS, running=holders, now=now,
                                    duration_seconds=job.limit,
                                    expected=expected_runtimes(model, queue, holders, by_id, now))
            key = (PRIORITY_RANK[job.spec.priority], index)
            at = bisect.bisect(order, key)
            order.insert(at, key)
            queue.insert(at, QueuedJob(job.job_id, job.spec, job.limit))
        decision = schedule(queue, nodes, FLAVORS, running=list(running.values()), now=now)
        spent += time.perf_counter() - began
        started = set()
        for admission in decision.admissions:
            job = by_id[admission.job_id]
            job.started, job.flavor, job.backfilled = now, admission.flavor, admission.backfilled
            flavor = FLAVORS[admission.flavor]
            for name, amount in holdings(admission.placement, flavor).items():
                free[name] = free[name] - amount
            running[job.job_id] = RunningJob(
                job_id=job.job_id, spec=job.spec, flavor=flavor, placement=admission.placement,
                ends_at=now + timedelta(seconds=job.limit) if job.limit else None)
            heapq.heappush(completions, (now + timedelta(seconds=job.runtime), job.job_id))
            started.add(job.job_id)
        keep = [i for i, queued in enumerate(queue) if queued.job_id not in started]
        queue = [queue[i] for i in keep]
        order = [order[i] for i in keep]
        if not running and queue and not arrivals:
            break  # what is left can never start
    return spent


def accuracy(queued: list[tuple[Job, datetime | None]]) -> list[tuple[str, str]]:
    """Rows on one estimate of the jobs that queued: (job, its estimated start)."""
    known = [(estimate, j.started) for j, estimate in queued if estimate and j.started]
    errors = [abs((actual - estimate).total_seconds()) / 60 for estimate, actual in known]
    # How much longer than the real wait the estimated wait was (at least a minute of real wait).
    ratios = [(estimate - j.arrival) / max(actual - j.arrival, timedelta(minutes=1))
              for j, estimate in queued if estimate and (actual := j.started)]
    upper = sum(1 for estimate, actual in known if actual <= estimate)
    unknown = sum(1 for _, estimate in queued if estimate is None)

    def within(minutes: int) -> str:
        return f"{sum(1 for e in errors if e <= minutes) / len(errors):.1%}" if errors else "-"

    return [
        ("queued with a known estimate", f"{len(known)} of {len(queued)}"),
        ("  median / p90 absolute error", f"{statistics.median(errors):.0f} / {_p90(errors):.0f} min"
         if errors else "-"),
        ("  started exactly then", f"{sum(1 for e in errors if e < 1 / 60) / len(errors):.1%}" if errors else "-"),
        ("  started within 30 min / 2 h of it", f"{within(30)} / {within(120)}"),
        ("  estimate was an upper bound (started no later)", f"{upper / len(known):.1%}" if known else "-"),
        ("  median estimated wait / actual wait", f"{statistics.median(ratios):.2f}" if ratios else "-"),
        ("queued with an unknown estimate", f"{unknown / len(queued):.1%}" if queued else "-"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1500)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--load", type=float, default=0.9, help="offered load against the cluster's CPUs")
    parser.add_argument("--unlimited", type=float, default=0.1, help="share of jobs without a duration limit")
    parser.add_argument("--runtime", type=float, nargs=2, default=(0.3, 1.0), metavar=("LOW", "HIGH"),
                        help="jobs run for a share of their limit between LOW and HIGH (default 0.3 1.0)")
    parser.add_argument("--users", type=int, default=8, help="users submitting the jobs (default 8)")
    parser.add_argument("--habits", action="store_true", help="each user runs jobs for their own share of the limit")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cycles", type=int, help="cycles a playthrough plays (default: SIMULATION_NODE_CYCLES "
                        "divided by the nodes, and SIMULATION_JOB_CYCLES by the waiting jobs)")
    parser.add_argument("--planned", type=int, help="jobs the conservative plan places one by one past a playthrough "
                        "(default: HORIZON_NODE_JOBS divided by the nodes); those behind get the rough, fluid plan")
    args = parser.parse_args()
    if args.cycles:
        playthrough.SIMULATION_NODE_CYCLES = args.cycles * args.nodes
        playthrough.SIMULATION_JOB_CYCLES = 1 << 62  # the cycles given, however deep the queue
    if args.planned:
        playthrough.HORIZON_NODE_JOBS = args.planned * args.nodes
    rng = random.Random(args.seed)
    jobs = workload(args.jobs, args.nodes, args.load, args.unlimited, rng, (args.runtime[0], args.runtime[1]),
                    args.users, args.habits, random.Random(-args.seed))
    spent = replay(jobs, args.nodes, rng)

    pairs = [(j, f.prediction) for j in jobs if (f := j.forecast) is not None]
    now_right = sum(1 for j, p in pairs if p.starts_now == (j.started == j.arrival))
    said_now = [j for j, p in pairs if p.starts_now]
    queued = [j for j, p in pairs if not p.starts_now]
    waits = [(j.started - j.arrival).total_seconds() / 60 for j in jobs if j.started and j.started > j.arrival]

    habits = "each user's own share" if args.habits else f"{args.runtime[0]:.0%}-{args.runtime[1]:.0%}"
    bounds = (f"playthroughs of at most {playthrough.SIMULATION_NODE_CYCLES // args.nodes} cycles "
              f"({playthrough.SIMULATION_JOB_CYCLES:,} divided by the waiting jobs), then "
              f"{playthrough.HORIZON_NODE_JOBS // args.nodes} jobs planned one by one")
    print(f"{len(jobs)} jobs of {args.users} users on {args.nodes} nodes, offered load {args.load:.0%}, "
          f"{args.unlimited:.0%} without a duration limit, runtimes {habits} of the limit, seed {args.seed}; "
          f"python {platform.python_version()}; {bounds}; {spent:.1f} s predicting and scheduling\n")
    rows = [
        ("jobs predicted", f"{len(pairs)}", ""),
        ("jobs that never started (fit on no node)", f"{sum(1 for j in jobs if j.started is None)}", ""),
        ("median / p95 wait of the jobs that queued", f"{statistics.median(waits):.0f} / {p95(waits):.0f} min"
         if waits else "-", ""),
        ("'starts now' or 'queues' right", f"{now_right / len(pairs):.1%}", ""),
        ("  said 'starts now' and it did", f"{sum(1 for j in said_now if j.started == j.arrival)} of {len(said_now)}",
         ""),
        ("queued jobs estimated roughly (deep in the queue)",
         f"{sum(1 for j in queued if j.forecast and ROUGH in j.forecast.prediction.reason)} of {len(queued)}", ""),
        ("queued jobs that started ahead of their turn", f"{sum(1 for j in queued if j.backfilled)} of {len(queued)}",
         ""),
        ("", "latest start", "likely start"),
    ]
    latest = accuracy([(j, j.forecast.latest_start if j.forecast else None) for j in queued])
    likely = accuracy([(j, j.forecast.prediction.estimated_start if j.forecast else None) for j in queued])
    rows += [(label, before, after) for (label, before), (_, after) in zip(latest, likely, strict=True)]
    width = max(len(label) for label, _, _ in rows)
    middle = max(len(value) for _, value, _ in rows)
    for label, value, other in rows:
        print(f"{label.ljust(width)}  {value.ljust(middle)}  {other}".rstrip())


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
