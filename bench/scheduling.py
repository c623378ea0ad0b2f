"""How fast the scheduler decides: one cycle over a big queue, draining it, and predictions.

    python -m bench.scheduling [--jobs 10000] [--nodes 1000] [--repeats 7] [--seed 1] [--cycles 200] [--cycle-only]

The cluster mixes CPU and accelerator nodes, some in dedicated pools; running jobs fill most of it,
and the queue mixes priorities, sizes (1-8 nodes), flavors, elastic and TensorFlow jobs, with and
without duration limits. Predictions are measured without a cache (the queue planned for each one,
limits only), and with a `PredictionCache` whose runtime model has seen 2,000 finished jobs, cold
(first prediction after a state change) and warm, with the cycle collector paused as the scheduler's
planning thread runs them. Everything is virtual time: only the decision
logic is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import msgspec

from libs.contracts.cluster import Accelerators, ClusterConfig, Flavor, NodeInfo, Resources
from libs.contracts.events import Event, EventEnvelope, JobAdmitted, JobSubmitted, JobSucceeded, NodeRegistered
from libs.contracts.jobspec import PRIORITY_RANK, CheckpointResume, Elastic, JobSpec, Priority
from libs.placement import (
    Capacity,
    Cluster,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningChange,
    RunningJob,
    choose,
    holdings,
    schedule,
)
from libs.skeleton.eventsourced import collector_paused
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.decision_inputs import plan_inputs
from services.scheduler.planning.prediction import predict, predict_queue
from services.scheduler.planning.prediction_cache import PlanInputs, PredictionCache
from services.scheduler.planning.runtime_model import JobRecord, RuntimeModel, Traits
from services.scheduler.planning.simulation import insertion_index
from services.scheduler.planning.thread import PlanningThread
from services.scheduler.rules.cycle import decide

START = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
POOLS = ["team-a", "team-b"]
FLAVORS = {f.name: f for f in (
    Flavor(name="cpu-4", cpus=4, memory_mib=16_384),
    Flavor(name="cpu-16", cpus=16, memory_mib=65_536),
    Flavor(name="cpu-32", cpus=32, memory_mib=131_072),
    Flavor(name="a100-1", cpus=12, memory_mib=131_072, accelerators=1, board="A100"),
    Flavor(name="a100-4", cpus=48, memory_mib=524_288, accelerators=4, board="A100"),
    Flavor(name="a100-8", cpus=96, memory_mib=1_048_576, accelerators=8, board="A100"),
    Flavor(name="mlu-4", cpus=32, memory_mib=262_144, accelerators=4, board="MLU370"),
)}
# Equivalent flavor lists users give (S5): CPU jobs, A100 jobs, and either board.
FLAVOR_CHOICES = [["cpu-4"], ["cpu-16"], ["cpu-32", "cpu-16"], ["a100-1"], ["a100-4"], ["a100-8", "a100-4"],
                  ["mlu-4"], ["a100-4", "mlu-4"]]


def build_nodes(count: int, rng: random.Random) -> list[NodeInfo]:
    """60% CPU nodes, 30% A100 nodes, 10% MLU370 nodes; one node in ten in a dedicated pool."""
    nodes = []
    for index in range(count):
        kind = rng.random()
        pools = [rng.choice(POOLS)] if rng.random() < 0.1 else []
        name = f"node-{index:05}"
        if kind < 0.6:
            nodes.append(NodeInfo(name=name, address=f"10.0.{index // 250}.{index % 250}", cpus=64,
                                  memory_mib=262_144, pools=pools))
        else:
            board, driver = ("A100", rng.choice(["535.104", "550.54"])) if kind < 0.9 else ("MLU370", "5.10")
            nodes.append(NodeInfo(name=name, address=f"10.1.{index // 250}.{index % 250}", cpus=96,
                                  memory_mib=1_048_576, pools=pools,
                                  accelerators=[Accelerators(board=board, count=8, driver_version=driver)]))
    return nodes


def random_spec(rng: random.Random, index: int) -> tuple[JobSpec, int | None]:
    """A job spec and its duration limit in seconds (None: no limit)."""
    levels: list[Priority] = ["very-urgent", "urgent", "normal"]
    priority = rng.choices(levels, weights=[2, 13, 85])[0]
    nodes = rng.choices([1, 2, 3, 4, 6, 8], weights=[45, 20, 10, 12, 5, 8])[0]
    flavors = rng.choice(FLAVOR_CHOICES)
    duration = rng.choice([None, 1800, 3600, 7200, 14_400, 28_800, 86_400]) if rng.random() > 0.1 else None
    pool: str | None = None
    resume: CheckpointResume | None = None
    driver: str | None = None
    kind = rng.random()
    if kind < 0.05:  # elastic jobs need a dedicated pool (J12)
        pool = rng.choice(POOLS)
        resume = CheckpointResume(elastic=Elastic(min_nodes=max(1, nodes // 2)))
    elif kind < 0.10:
        pool = rng.choice(POOLS)
    elif kind < 0.13:
        return JobSpec(name=f"tf-{index}", mode="tensorflow", nodes=nodes, parameter_servers=rng.randint(1, 2),
                       flavors=flavors, priority=priority), duration
    elif kind < 0.15 and flavors[0].startswith("a100"):
        driver = "535.104"
    return JobSpec(name=f"job-{index}", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=flavors,
                   priority=priority, pool=pool, checkpoint_resume=resume, driver_version=driver), duration


def build_queue(count: int, rng: random.Random) -> list[QueuedJob]:
    jobs = []
    for index in range(count):
        spec, duration = random_spec(rng, index)
        jobs.append(QueuedJob(f"job-{index:06}", spec, duration))
    return sorted(jobs, key=lambda job: PRIORITY_RANK[job.spec.priority])  # stable: FIFO within a level


@dataclass(frozen=True)
class Record:
    """A job as the runtime model reads it."""

    spec: JobSpec
    creator: str = ""
    flavor: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    duration_seconds: int | None = None


def fill(nodes: list[NodeInfo], rng: random.Random, now: datetime,
         records: dict[str, JobRecord] | None = None) -> tuple[list[NodeCapacity], list[RunningJob]]:
    """Running jobs placed until random jobs keep failing to fit, each some way into its duration.
    `records` receives each one's start and limit."""
    capacity = Capacity.of(NodeCapacity(info=n, free=Resources.of_node(n)) for n in nodes)
    running: list[RunningJob] = []
    misses = 0
    while misses < 300:
        spec, duration = random_spec(rng, len(running))
        choice = choose(capacity, spec, FLAVORS)
        if choice is None:
            misses += 1
            continue
        misses = 0
        flavor = FLAVORS[choice[0]]
        capacity.take(holdings(choice[1], flavor))
        ends = now + timedelta(seconds=rng.randint(60, duration)) if duration else None
        job_id = f"run-{len(running):06}"
        running.append(RunningJob(job_id=job_id, spec=spec, flavor=flavor, placement=choice[1], ends_at=ends))
        if records is not None:
            started = ends - timedelta(seconds=duration) if ends and duration else now - timedelta(hours=1)
            records[job_id] = Record(spec, flavor=flavor.name, started_at=started, duration_seconds=duration)
    free = [NodeCapacity(info=n, free=capacity.free[n.name]) for n in nodes]
    return free, running


def _same(inputs: PlanInputs) -> PlanInputs:
    return inputs


def history(count: int, rng: random.Random) -> RuntimeModel:
    """A runtime model that has seen `count` finished random jobs, each running 30-100% of its limit
    (1-8 hours without one)."""
    model = RuntimeModel()
    for index in range(count):
        spec, duration = random_spec(rng, index)
        runtime = duration * rng.uniform(0.3, 1.0) if duration else rng.uniform(3600, 28_800)
        model.observe(Traits.of(spec), duration, runtime)
    return model


def share_held(nodes: list[NodeCapacity]) -> tuple[float, float]:
    """The share of CPUs and of accelerators held by running jobs."""
    total = [Resources.of_node(n.info) for n in nodes]
    cpus = 1 - sum(n.free.cpus for n in nodes) / sum(t.cpus for t in total)
    accelerators = 1 - sum(n.free.accelerators for n in nodes) / max(1, sum(t.accelerators for t in total))
    return cpus, accelerators


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        samples.append(time.perf_counter() - began)
    return samples


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def p95(samples: list[float]) -> float:
    return percentile(samples, 0.95)


def p99(samples: list[float]) -> float:
    return percentile(samples, 0.99)


def paused(call: Callable[[], object]) -> Callable[[], object]:
    """`call` with the cycle collector paused, as the scheduler makes its decisions."""
    def run() -> object:
        with collector_paused():
            return call()
    return run


def steady(nodes: list[NodeCapacity], running: list[RunningJob], queue: list[QueuedJob], cycles: int, *,
           changes: bool) -> list[float]:
    """Cycles as the scheduler runs them while little changes, the last cycle's `Cluster` kept: a second passes
    between two cycles and, with `changes`, a job arrives in the queue or a running one ends before each (in turn).
    The jobs a cycle admits start, as the scheduler's do: they leave the queue and hold their nodes from the next cycle
    on (growths are not carried out). Each cycle is told how the running jobs changed since the last, as the
    scheduler's state tells it (`RunningChange`)."""
    kept = Cluster(n.info for n in nodes)
    free = {n.info.name: n for n in nodes}
    live = list(running)
    waiting = list(queue)
    rng = random.Random(7)
    samples = []
    given: list[RunningJob] | None = None
    for index in range(cycles + 1):
        now = START + timedelta(seconds=index)
        gone, added = [], live[len(given):] if given is not None else []  # (admitted jobs are appended)
        if changes and index % 2:
            spec, duration = random_spec(rng, len(queue) + index)
            joined = QueuedJob(f"arrived-{index:06}", spec, duration)
            waiting.insert(insertion_index(waiting, spec.priority), joined)
        elif changes and index:
            job = live.pop(rng.randrange(len(live)))
            if job in added:
                added.remove(job)
            else:
                gone.append(job)
            for name, amount in job.held.items():
                free[name] = NodeCapacity(info=free[name].info, free=free[name].free + amount)
        listed = list(free.values())
        change = None if given is None else RunningChange(given, gone, added)
        given = list(live)
        began = time.perf_counter()
        with collector_paused():  # as the scheduler decides (services/scheduler/service.py)
            decision = schedule(waiting, listed, FLAVORS, running=given, now=now, cluster=kept, running_change=change)
        if index:  # the first one works out what the others keep
            samples.append(time.perf_counter() - began)
        started(decision, waiting, live, free, now)
    return samples


def started(decision: Decision, waiting: list[QueuedJob], live: list[RunningJob], free: dict[str, NodeCapacity],
            now: datetime) -> None:
    """The decision's admissions carried out: the jobs leave the queue, run, and hold their nodes."""
    admitted = {admission.job_id: admission for admission in decision.admissions}
    if not admitted:
        return
    for job in [job for job in waiting if job.job_id in admitted]:
        admission = admitted[job.job_id]
        ends = now + timedelta(seconds=job.duration_seconds) if job.duration_seconds is not None else None
        running = RunningJob(job_id=job.job_id, spec=job.spec, flavor=FLAVORS[admission.flavor],
                             placement=admission.placement, ends_at=ends)
        live.append(running)
        for name, amount in running.held.items():
            free[name] = NodeCapacity(info=free[name].info, free=free[name].free - amount)
    waiting[:] = [job for job in waiting if job.job_id not in admitted]


def cycle_rows(nodes: list[NodeCapacity], running: list[RunningJob], queue: list[QueuedJob], args: argparse.Namespace,
               ) -> list[tuple[str, str, str, str, str]]:
    """One cycle from scratch, over the same inputs with the cluster kept, and in a steady state."""
    cycle = timed(paused(lambda: schedule(queue, nodes, FLAVORS, running=running, now=START)), args.repeats)
    # As the scheduler runs it: the last cycle's cluster over the same nodes kept (services/scheduler/rules/cycle.py)
    kept = Cluster(n.info for n in nodes)
    schedule(queue, nodes, FLAVORS, running=running, now=START, cluster=kept)
    cycle_kept = timed(paused(lambda: schedule(queue, nodes, FLAVORS, running=running, now=START, cluster=kept)),
                       max(args.repeats, args.cycles))
    quiet = steady(nodes, running, queue, args.cycles, changes=False)
    busy = steady(nodes, running, queue, args.cycles, changes=True)

    def row(name: str, samples: list[float], note: str) -> tuple[str, str, str, str, str]:
        return (name, f"{statistics.median(samples) * 1000:.1f} ms", f"{p95(samples) * 1000:.1f} ms",
                f"{p99(samples) * 1000:.1f} ms", note)

    return [
        row("schedule: one cycle", cycle, f"{len(queue) / statistics.median(cycle):,.0f} decisions/s"),
        row("schedule: one cycle, cluster kept", cycle_kept, "as the scheduler's cycles over the same nodes"),
        row("schedule: steady, time passes", quiet, f"{len(quiet)} cycles a second apart, nothing else changes"),
        row("schedule: steady, a job arrives or ends", busy, f"{len(busy)} cycles, one change before each"),
    ]


def state_rows(infos: list[NodeInfo], running: list[RunningJob], queue: list[QueuedJob], records: dict[str, JobRecord],
               cycles: int) -> list[tuple[str, str, str, str, str]]:
    """The scheduler's own cycle (`decide`, services/scheduler/rules/cycle.py): what it decides on read from its state
    as the service reads it, then the decision, with the cycle collector paused. A second passes between two cycles;
    in the second row a running job ends before each (its JobSucceeded folded); each cycle's admissions are folded
    as JobAdmitted, as the scheduler records them."""
    state = scheduler_state(infos, running, queue, records)
    rng = random.Random(7)
    ending = [job.job_id for job in running]
    position = 10**9

    def fold(job_id: str, event: Event, at: datetime) -> None:
        nonlocal position
        position += 1
        state.apply(EventEnvelope(event_id=f"e{position}", service="scheduler", aggregate_type="job",
                                  aggregate_id=job_id, version=position, position=position, recorded_at=at,
                                  event=event))

    rows = []
    for name, change in (("decide: the scheduler's cycle, time passes", False),
                         ("decide: the scheduler's cycle, a job ends", True)):
        samples = []
        for index in range(cycles + 1):
            now = START + timedelta(seconds=index)
            if change and index:
                ended = ending.pop(rng.randrange(len(ending)))
                fold(ended, JobSucceeded(job_id=ended), now)
            began = time.perf_counter()
            with collector_paused():
                decision = decide(state, now)
            if index:
                samples.append(time.perf_counter() - began)
            for admission in decision.admissions if decision is not None else ():
                fold(admission.job_id, JobAdmitted(job_id=admission.job_id, attempt=1, flavor=admission.flavor,
                                                   placement=admission.placement), now)
        rows.append((name, f"{statistics.median(samples) * 1000:.1f} ms", f"{p95(samples) * 1000:.1f} ms",
                     f"{p99(samples) * 1000:.1f} ms", f"{len(samples)} cycles, inputs read from the state"))
    return rows


def scheduler_state(infos: list[NodeInfo], running: list[RunningJob], queue: list[QueuedJob],
                    records: dict[str, JobRecord]) -> SchedulerState:
    """The cluster, running jobs and queue as the scheduler's state holds them, folded from events."""
    state = SchedulerState(ClusterConfig(flavors=list(FLAVORS.values())))
    position = 0

    def fold(service: str, aggregate: str, key: str, event: Event, at: datetime = START) -> None:
        nonlocal position
        position += 1
        state.apply(EventEnvelope(event_id=f"e{position}", service=service, aggregate_type=aggregate,
                                  aggregate_id=key, version=position, position=position, recorded_at=at,
                                  event=event))

    def with_limit(spec: JobSpec, seconds: int | None) -> JobSpec:
        return msgspec.structs.replace(spec, duration=f"{seconds}s" if seconds else None)

    for node in infos:
        fold("monitor", "node", node.name, NodeRegistered(node=node))
    for job in running:
        record = records[job.job_id]
        fold("scheduler", "job", job.job_id, JobSubmitted(job_id=job.job_id, creator=record.creator,
                                                           spec=with_limit(job.spec, record.duration_seconds)))
        fold("scheduler", "job", job.job_id, JobAdmitted(job_id=job.job_id, attempt=1, flavor=job.flavor.name,
                                                          placement=job.placement), record.started_at or START)
    for queued in queue:
        fold("scheduler", "job", queued.job_id, JobSubmitted(job_id=queued.job_id, creator="",
                                                              spec=with_limit(queued.spec, queued.duration_seconds)))
    return state


async def on_the_loop(planning: PlanningThread, spec: JobSpec, inputs: Callable[[], PlanInputs],
                      ) -> tuple[float, float]:
    """A prediction planned in a worker thread: how long it took, and the longest the event loop was
    held meanwhile (a task that asks to run every millisecond notes how late it ran)."""
    done = False
    longest = 0.0

    async def ticking() -> None:
        nonlocal longest
        while not done:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            longest = max(longest, time.perf_counter() - asked - 0.001)

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0)
    began = time.perf_counter()
    await planning.forecast(spec, clock=lambda: START, inputs=inputs)
    took = time.perf_counter() - began
    done = True
    await ticker
    return took, longest


def drain(nodes: list[NodeCapacity], running: list[RunningJob], queue: list[QueuedJob], cycles: int,
          ) -> tuple[int, int, float]:
    """Cycle after cycle, the 20 earliest-ending running jobs finish and the scheduler admits what
    fits. Returns (cycles run, jobs admitted, seconds spent in `schedule`)."""
    free = {n.info.name: n for n in nodes}
    live = {job.job_id: job for job in running}
    durations = {job.job_id: job.duration_seconds for job in queue}
    specs = {job.job_id: job.spec for job in queue}
    now = START
    done = admitted = 0
    spent = 0.0
    while done < cycles and queue:
        ending = sorted((j for j in live.values() if j.ends_at is not None), key=lambda j: j.ends_at or now)[:20]
        if not ending:
            break
        now = max(now, ending[-1].ends_at or now)
        for job in ending:
            for name, amount in holdings(job.placement, job.flavor).items():
                free[name] = NodeCapacity(info=free[name].info, free=free[name].free + amount)
            del live[job.job_id]
        began = time.perf_counter()
        decision = schedule(queue, list(free.values()), FLAVORS, running=list(live.values()), now=now)
        spent += time.perf_counter() - began
        done += 1
        started = set()
        for admission in decision.admissions:
            flavor = FLAVORS[admission.flavor]
            for name, amount in holdings(admission.placement, flavor).items():
                free[name] = NodeCapacity(info=free[name].info, free=free[name].free - amount)
            seconds = durations[admission.job_id]
            live[admission.job_id] = RunningJob(
                job_id=admission.job_id, spec=specs[admission.job_id], flavor=flavor, placement=admission.placement,
                ends_at=now + timedelta(seconds=seconds) if seconds else None)
            started.add(admission.job_id)
        admitted += len(started)
        queue = [job for job in queue if job.job_id not in started]
    return done, admitted, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000, help="queued jobs (default 10000)")
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes (default 1000)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of each measurement (default 7)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cycles", type=int, default=200, help="cycles of the steady-state rows (default 200)")
    parser.add_argument("--cycle-only", action="store_true", help="only the rows of one cycle, no predictions")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    infos = build_nodes(args.nodes, rng)
    records: dict[str, JobRecord] = {}
    nodes, running = fill(infos, rng, START, records)
    queue = build_queue(args.jobs, rng)
    records.update({job.job_id: Record(job.spec, duration_seconds=job.duration_seconds) for job in queue})
    cpus, accelerators = share_held(nodes)
    print(f"cluster: {args.nodes} nodes, {len(running)} running jobs holding {cpus:.0%} of the CPUs and "
          f"{accelerators:.0%} of the accelerators; queue: {len(queue)} jobs")
    print(f"python {platform.python_version()} on {platform.machine()}\n")

    decision = schedule(queue, nodes, FLAVORS, running=running, now=START)
    head = decision.reservation
    print(f"one cycle: {len(decision.admissions)} admitted ({sum(a.backfilled for a in decision.admissions)} "
          f"backfilled), {len(decision.growths)} grown, {len(decision.unplaceable)} unplaceable, "
          f"head reserved {'at ' + str(head.start) if head and head.start else 'with an unknown start'}\n")
    header = ("measure", "median", "p95", "p99", "throughput")
    one_cycle = cycle_rows(nodes, running, queue, args) + state_rows(infos, running, queue, records, args.cycles)
    if args.cycle_only:
        show([header, *one_cycle])
        return

    empty = [NodeCapacity(info=n, free=Resources.of_node(n)) for n in infos]
    first = schedule(queue, empty, FLAVORS, now=START)
    filling = timed(lambda: schedule(queue, empty, FLAVORS, now=START), max(1, args.repeats // 3))

    probes = [random_spec(rng, args.jobs + i)[0] for i in range(args.repeats)]
    predictions = []
    for spec in probes:
        began = time.perf_counter()
        predict(spec, queue, nodes, FLAVORS, running=running, now=START)
        predictions.append(time.perf_counter() - began)
    model = history(2000, rng)
    inputs = PlanInputs(queue=queue, nodes=nodes, flavors=FLAVORS, running=running, jobs=records)
    # The cache's own rows: as the planning thread runs them, with the cycle collector paused.
    cold: list[float] = []
    for spec in probes:  # a new cache each time: the first prediction after a state change
        cache = PredictionCache(model)
        began = time.perf_counter()
        with collector_paused():
            cache.predict(spec, now=START, inputs=lambda: inputs)
        cold.append(time.perf_counter() - began)
    warm: list[float] = []
    for _ in range(3):
        for spec in probes:
            began = time.perf_counter()
            with collector_paused():
                cache.predict(spec, now=START, inputs=lambda: inputs)
            warm.append(time.perf_counter() - began)
    submitted: list[float] = []  # each probe is submitted, then the next one predicted
    current = inputs
    for index, spec in enumerate(probes):
        job_id = f"new-{index:06}"
        place = insertion_index(current.queue, spec.priority)
        records[job_id] = Record(spec, duration_seconds=spec.max_duration_seconds)
        joined = QueuedJob(job_id, spec, spec.max_duration_seconds)
        current = PlanInputs(queue=[*current.queue[:place], joined, *current.queue[place:]], nodes=nodes,
                             flavors=FLAVORS, running=running, jobs=records)
        event = EventEnvelope(event_id=job_id, service="scheduler", aggregate_type="job", aggregate_id=job_id,
                              version=1, position=index, recorded_at=START,
                              event=JobSubmitted(job_id=job_id, spec=spec, creator=""))
        began = time.perf_counter()
        cache.applied(event, records)
        with collector_paused():
            cache.predict(probes[(index + 1) % len(probes)], now=START, inputs=functools.partial(_same, current))
        submitted.append(time.perf_counter() - began)
    state = scheduler_state(infos, running, queue, records)
    copies = timed(lambda: plan_inputs(state, START), args.repeats)
    threaded_cold: list[tuple[float, float]] = []
    threaded_warm: list[tuple[float, float]] = []

    async def in_threads() -> None:
        for spec in probes[: max(1, args.repeats // 2)]:  # a new cache each time: cold, then warm
            planning = PlanningThread(PredictionCache(model))
            threaded_cold.append(await on_the_loop(planning, spec, functools.partial(plan_inputs, state, START)))
            threaded_warm.append(await on_the_loop(planning, spec, functools.partial(plan_inputs, state, START)))

    asyncio.run(in_threads())
    plan_all = timed(lambda: predict_queue(queue, nodes, FLAVORS, running=running, now=START),
                     max(1, args.repeats // 3))
    cycles, admitted, spent = drain(nodes, running, queue, cycles=50)

    rows = [
        ("schedule: empty cluster", f"{statistics.median(filling) * 1000:.0f} ms",
         f"{p95(filling) * 1000:.0f} ms",
         f"{len(first.admissions)} admitted, {len(first.admissions) / statistics.median(filling):,.0f} admitted/s"),
        ("predict: no cache, limits only", f"{statistics.median(predictions) * 1000:.0f} ms",
         f"{p95(predictions) * 1000:.0f} ms", f"{len(probes)} specs"),
        ("predict: cache, cold", f"{statistics.median(cold) * 1000:.0f} ms", f"{p95(cold) * 1000:.0f} ms",
         "likely and latest starts"),
        ("predict: cache, warm", f"{statistics.median(warm) * 1000:.1f} ms", f"{p95(warm) * 1000:.1f} ms",
         f"{len(warm)} predictions"),
        ("predict: cache, after a submission", f"{statistics.median(submitted) * 1000:.1f} ms",
         f"{p95(submitted) * 1000:.1f} ms", "the job taken into the plan"),
        ("plan inputs copied from the state", f"{statistics.median(copies) * 1000:.0f} ms",
         f"{p95(copies) * 1000:.0f} ms", "on the loop, for a new plan"),
        ("predict in a thread, cold: took", f"{statistics.median(t for t, _ in threaded_cold) * 1000:.0f} ms",
         f"{p95([t for t, _ in threaded_cold]) * 1000:.0f} ms", f"{len(threaded_cold)} specs, the copy included"),
        ("predict in a thread, cold: loop held", f"{statistics.median(h for _, h in threaded_cold) * 1000:.0f} ms",
         f"{p95([h for _, h in threaded_cold]) * 1000:.0f} ms", "the longest wait of a task on the loop"),
        ("predict in a thread, warm: took", f"{statistics.median(t for t, _ in threaded_warm) * 1000:.1f} ms",
         f"{p95([t for t, _ in threaded_warm]) * 1000:.1f} ms", ""),
        ("predict in a thread, warm: loop held", f"{statistics.median(h for _, h in threaded_warm) * 1000:.1f} ms",
         f"{p95([h for _, h in threaded_warm]) * 1000:.1f} ms", ""),
        ("predict_queue: every job", f"{statistics.median(plan_all) * 1000:.0f} ms", f"{p95(plan_all) * 1000:.0f} ms",
         f"{len(queue) / statistics.median(plan_all):,.0f} jobs/s"),
        ("drain: cycles as jobs end", f"{spent / max(cycles, 1) * 1000:.0f} ms/cycle", "",
         f"{admitted} admitted in {cycles} cycles, {admitted / spent:,.0f} admitted/s"),
    ]
    show([header, *one_cycle, *((name, median, high, "", note) for name, median, high, note in rows)])


def show(rows: list[tuple[str, str, str, str, str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in [rows[0], tuple("-" * w for w in widths), *rows[1:]]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
