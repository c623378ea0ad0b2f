"""Start estimates beside Slurm's `squeue --start`: one trace, replayed by Trainyard's scheduler and by a real Slurm.

    python -m bench.start_estimates [--jobs 55] [--minutes 1 4] [--load 0.9] [--seed 2] [--margin 2]
                                    [--bf-resolution 1] [--quick] [--no-slurm] [--csv FILE]

The trace is a compressed form of the accuracy workload (bench/prediction_accuracy.py), run by both sides: a
cluster of 8 nodes of 16 CPUs and 4,000 MiB, CPU jobs arriving at random (Poisson, on whole seconds), spaced so
that the offered load is 90% of the CPUs over the arrivals and queues form, seeded (seed 2 by default, whose
queue is deeper than seed 1's: 39 of 55 jobs queue on Trainyard's side, against 19). A job takes 1 node (60%: 2, 4,
8 or all 16 of its CPUs, with memory in proportion, 250 MiB a CPU) or 2-4 whole nodes; its time limit is a whole
number of minutes (Slurm's `--time` counts minutes), 1-4 by default. Every job runs to its limit, as the exactness
workload of the accuracy benchmark (`--unlimited 0 --runtime 1 1`): nothing then makes an estimate wrong but
what the estimate cannot know, the jobs submitted after it, and each system's own reaction times.

Where reality demands a compromise:

- A job of several nodes takes them whole. Trainyard places the ranks of a job on the roomiest nodes and may put
  two on one node when it must, where Slurm's `-N k` takes k distinct nodes: with whole nodes both sides ask for
  exactly the same thing.
- On Slurm a job is a batch script that sleeps `--margin` (2) seconds less than its limit: a job still running
  at its limit is stopped (TIMEOUT) only at slurmctld's next check of limits, which comes every 30 s, so it would
  hold its nodes up to 30 s past its limit. So Slurm's jobs end a couple of seconds before the limit its
  estimates assume. Trainyard's side is played twice: jobs running exactly to their limits, and jobs ending
  `--margin` seconds early as Slurm's do.

Trainyard's side runs in virtual time through the scheduler's own code, as the service runs it: its state fold
(`SchedulerState`) takes the events (nodes registered, jobs submitted, admitted, succeeded), and at every
submission and end the cycle the service runs (`cycle.decide`, `cycle.admissions`, again after its own
admissions until one admits nothing). At each arrival the job is predicted first, as `trainyard predict`
answers it: the service's `PredictionCache` (its `forecast`, which the service runs in its planning thread),
fed every event the state folds and planning from `plan_inputs` of the state, as the service does. (The
accuracy benchmark calls `prediction.forecast` afresh for every arrival; the cache answers the same from a plan
it keeps while only submissions came since, for up to 30 s: a property test holds it to that.) The estimate is
`estimated_start`, the likely start a user is shown; with every job running to its limit it is the latest start.
What starts a job is the scheduler's cycle at that instant, so the real starts are exact virtual instants.

Slurm's side is a real Slurm (bench/slurm.py: munged, slurmctld and 8 slurmd on this host, `select/cons_tres`
with `CR_Core_Memory`, FIFO priorities, `priority/basic`), configured for its most precise and prompt
estimates: `sched/backfill` with `bf_interval=1` (a backfill pass every second when something changed) and
`bf_resolution=1` (plans to the second, instead of the default minute), beside the throughput settings
(`sched_min_interval=0`, `batch_sched_delay=0`, `default_queue_depth=1000`); `bf_window` is its default, a day.
In real time, from a whole second: each job is submitted with `sbatch -N k --ntasks-per-node=1 -c CPUS
--mem=MiB --time=MINUTES --wrap 'sleep S'` at its arrival, and `squeue` is polled (every 0.1 s while a job
submitted in the last few seconds has no answer yet, else every 0.5 s). A pending job's start time there is
what `squeue --start` shows; Slurm fills it in at a scheduling pass, so the estimate at submission is the first
answer a job gets: the start it is given while pending, or, when it is found running first, "started at
submission". A job still without an estimate 10 s after its submission has none. The first answer may come from
the main scheduler's try at submission, before a backfill pass has planned the job, so the estimate is read again
3 s after the submission (a backfill pass has run since: the submission changed the queue), while the job still
waits, and reported apart. Each job's real start and end are Slurm's own (`squeue` lists finished jobs for
`MinJobAge`), in whole seconds since the trace's start.

Reported for each side: how many jobs queued (the answer at submission was a wait, not "starts now"), and of
those with an estimate the median and p90 absolute error, the share within 1 s, 10 s and 1 min of it, the share
of estimates that were upper bounds (the job started no later), the median ratio of estimated to real wait, and
the share with no estimate (an error counts estimates; the wait ratio, jobs that waited at least 1 s); for Slurm
also its reaction times: submission to start of the jobs that started at once, and end of a job to the start of a
queued job that started then. The Slurm run takes as long as the trace plays, some 37 minutes by default;
`--quick` is an 8-job, 4-minute run, and `--jobs` and `--minutes` make it shorter. `--csv` writes every job of
every side (for Slurm also the nodes its first estimate planned it on, and those it ran on). Slurm's daemons and
folder go at exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import heapq
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from bench.slurm import JobTimes, SlurmPeer, slurm_missing, slurm_version
from libs.contracts.cluster import ClusterConfig, Flavor, NodeInfo
from libs.contracts.events import EventEnvelope, JobSubmitted, JobSucceeded, NodeRegistered
from libs.contracts.jobspec import JobSpec
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.decision_inputs import plan_inputs
from services.scheduler.planning.prediction import Forecast
from services.scheduler.planning.prediction_cache import PredictionCache
from services.scheduler.rules.cycle import admissions, decide

NODES, CPUS, MEMORY_MIB = 8, 16, 4000
START = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)  # the trace's start in virtual time
# Slurm's settings for prompt, precise estimates, beside bench/slurm.py's throughput ones.
BACKFILL = ("bf_interval=1",)
SINGLE_NODE_SHARE = 0.6  # the rest take 2, 3 or 4 whole nodes
SINGLE_NODE_CPUS = (2, 4, 8, 16)
MULTI_NODE_COUNTS = (2, 3, 4)
CAPTURE_SECONDS = 10.0  # a job without an answer this long after its submission has no estimate
SETTLE_SECONDS = 3.0  # a job's estimate is read again this long after its submission
FAST_POLL, SLOW_POLL = 0.1, 0.5  # squeue while a job waits for its answer, and otherwise
PROGRESS_SECONDS = 30.0
STALL_SECONDS = 300.0  # the Slurm run fails when nothing changes for this long more than the longest limit
QUICK = {"jobs": 8, "minutes": (1, 2)}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


# --- the trace -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceJob:
    """One job of the trace: when it arrives (seconds after the trace's start) and what it asks for."""

    index: int
    arrival: int
    nodes: int
    cpus: int  # per node
    memory_mib: int  # per node
    minutes: int  # its time limit, which it runs to

    @property
    def limit(self) -> int:
        return self.minutes * 60

    @property
    def flavor(self) -> str:
        return f"cpu-{self.cpus}"

    @property
    def demand(self) -> int:
        """CPU-seconds, running to its limit."""
        return self.nodes * self.cpus * self.limit


def flavors() -> dict[str, Flavor]:
    """A flavor per size of job: its CPUs on one node, and memory in proportion."""
    return {f"cpu-{cpus}": Flavor(name=f"cpu-{cpus}", cpus=cpus, memory_mib=MEMORY_MIB * cpus // CPUS)
            for cpus in SINGLE_NODE_CPUS}


def trace(count: int, rng: random.Random, *, load: float = 0.9, minutes: tuple[int, int] = (1, 6)) -> list[TraceJob]:
    """`count` jobs arriving at random on whole seconds (a Poisson process, rounded) so that the offered load is
    about `load` times the cluster's CPUs; each takes one node (part of it or whole) or 2-4 whole nodes, for a
    whole number of minutes between `minutes`."""
    low, high = minutes
    if not 1 <= low <= high:
        raise ValueError(f"minutes must be 1 <= LOW <= HIGH, not {low} {high}")
    shapes = []
    for _ in range(count):
        if rng.random() < SINGLE_NODE_SHARE:
            nodes, cpus = 1, rng.choice(SINGLE_NODE_CPUS)
        else:
            nodes, cpus = rng.choice(MULTI_NODE_COUNTS), CPUS
        shapes.append((nodes, cpus, rng.randint(low, high)))
    # Random gaps, scaled so that this trace's demand is `load` times the cluster's CPUs over its arrivals
    # (`offered_load`: the span of the arrivals and a mean gap more).
    gaps = [0.0, *(rng.expovariate(1.0) for _ in shapes[1:])]
    demand = sum(nodes * cpus * limit * 60 for nodes, cpus, limit in shapes)
    span = sum(gaps) * count / (count - 1) if count > 1 else 1.0
    scale = demand / (NODES * CPUS * load) / span
    jobs: list[TraceJob] = []
    clock = 0.0
    for index, ((nodes, cpus, limit), gap) in enumerate(zip(shapes, gaps, strict=True)):
        clock += gap * scale
        jobs.append(TraceJob(index=index, arrival=round(clock), nodes=nodes, cpus=cpus,
                             memory_mib=MEMORY_MIB * cpus // CPUS, minutes=limit))
    return jobs


def offered_load(jobs: Sequence[TraceJob]) -> float:
    """The trace's demand against the cluster's CPUs over its arrivals (a mean gap after the last)."""
    if len(jobs) < 2:
        return 0.0
    span: float = jobs[-1].arrival - jobs[0].arrival
    span += span / (len(jobs) - 1)
    return sum(job.demand for job in jobs) / (NODES * CPUS * span)


# --- what each side reports --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One job on one side; times in seconds after the trace's start."""

    job: TraceJob
    submitted: float | None = None
    waits: bool | None = None  # the answer at submission: it queues (False: it starts now); None: no answer
    estimate: float | None = None  # the start that answer gave (None: no estimate, or it starts now)
    start: float | None = None
    end: float | None = None
    state: str = ""
    answered_after: float | None = None  # seconds from the submission to the answer (Slurm)
    later: float | None = None  # the estimate shown SETTLE_SECONDS after the submission, while it waited (Slurm)
    planned: str = ""  # the nodes the first estimate planned it on (Slurm)
    nodes: str = ""  # the nodes it ran on (Slurm)


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def _share(count: int, total: int) -> str:
    return f"{count / total:.1%}" if total else "-"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 90 else f"{value / 60:.1f} min"


def rows(outcomes: Sequence[Outcome]) -> list[tuple[str, str]]:
    """The figures of one side."""
    started = [o for o in outcomes if o.start is not None and o.submitted is not None]
    queued = [o for o in outcomes if o.waits]
    now = [o for o in outcomes if o.waits is False]
    known = [o for o in queued if o.estimate is not None and o.start is not None]
    errors = [abs(o.start - o.estimate) for o in known if o.start is not None and o.estimate is not None]
    upper = sum(1 for o in known if o.start is not None and o.estimate is not None and o.start <= o.estimate + 0.5)
    ratios = [(o.estimate - o.submitted) / (o.start - o.submitted) for o in known
              if o.estimate is not None and o.start is not None and o.submitted is not None
              and o.start - o.submitted >= 1]
    waits = [o.start - o.submitted for o in queued if o.start is not None and o.submitted is not None]
    makespan = max((o.end for o in outcomes if o.end is not None), default=0.0)
    right_now = sum(1 for o in now if o.start is not None and o.submitted is not None and o.start - o.submitted <= 1)

    def within(seconds: float) -> int:
        return sum(1 for error in errors if error <= seconds)

    return [
        ("jobs / started", f"{len(outcomes)} / {len(started)}"),
        ("said 'starts now'", f"{len(now)}, {right_now} started within 1 s"),
        ("queued (the answer was a wait)", f"{len(queued)}"),
        ("  median / p90 wait", f"{_seconds(statistics.median(waits))} / {_seconds(_percentile(waits, 0.9))}"
         if waits else "-"),
        ("  with an estimate", f"{len(known)} of {len(queued)}"),
        ("  median / p90 absolute error",
         f"{_seconds(statistics.median(errors))} / {_seconds(_percentile(errors, 0.9))}" if errors else "-"),
        ("  started within 1 s / 10 s / 1 min of it",
         f"{_share(within(1), len(errors))} / {_share(within(10), len(errors))} / {_share(within(60), len(errors))}"),
        ("  estimate was an upper bound (started no later)", _share(upper, len(known))),
        ("  median estimated wait / real wait", f"{statistics.median(ratios):.2f}" if ratios else "-"),
        ("  no estimate", _share(len(queued) - len(known), len(queued))),
        ("last job ended after", _seconds(makespan)),
    ]


# --- Trainyard: the scheduler's own code in virtual time ---------------------------------------------------------


def spec_of(job: TraceJob) -> JobSpec:
    return JobSpec(name=f"est-{job.index}", mode="pytorch" if job.nodes > 1 else "single-node", nodes=job.nodes,
                   flavors=[job.flavor], command=f"sleep {job.limit}", duration=f"{job.minutes}m")


class VirtualService:
    """The scheduler's state fold, cycle rules and prediction cache, fed events in virtual time as the service
    feeds them."""

    def __init__(self, cluster_flavors: dict[str, Flavor]) -> None:
        self.state = SchedulerState(ClusterConfig(flavors=list(cluster_flavors.values())))
        self.predictions = PredictionCache()
        self.position = 0
        self.started: dict[str, datetime] = {}

    def record(self, event: Any, at: datetime, aggregate_type: str, aggregate_id: str,
               service: str = "scheduler") -> None:
        """Fold an event, and let the prediction cache take note, as `SchedulerService.fold` does."""
        self.position += 1
        envelope = EventEnvelope(event_id=f"e{self.position}", service=service, aggregate_type=aggregate_type,
                                 aggregate_id=aggregate_id, version=self.position, position=self.position,
                                 recorded_at=at, event=event)
        self.state.apply(envelope)
        self.predictions.applied(envelope, self.state.jobs)

    def predict(self, spec: JobSpec, now: datetime) -> Forecast:
        """What `trainyard predict` answers at `now` (`SchedulerService.predict`, without its thread)."""
        return self.predictions.forecast(spec, now=now, inputs=lambda: plan_inputs(self.state, now),
                                         duration_seconds=spec.max_duration_seconds)

    def cycles(self, now: datetime) -> list[str]:
        """The cycle at `now`, and again after its own admissions until one admits nothing; the jobs started."""
        started: list[str] = []
        while (decision := decide(self.state, now)) is not None and decision.admissions:
            for change in admissions(self.state, decision, now):
                self.record(change.event, now, change.aggregate_type, change.aggregate_id)
            for admission in decision.admissions:
                self.started[admission.job_id] = now
                started.append(admission.job_id)
        return started


def run_trainyard(jobs: Sequence[TraceJob], margin: int = 0) -> list[Outcome]:
    """The trace through the scheduler in virtual time, jobs running `margin` seconds less than their limits."""
    service = VirtualService(flavors())
    for k in range(1, NODES + 1):
        node = NodeInfo(name=f"node{k}", address=f"10.0.0.{k}", cpus=CPUS, memory_mib=MEMORY_MIB)
        service.record(NodeRegistered(node=node), START, "node", node.name, service="monitor")
    outcomes = {f"job-{job.index:012x}": Outcome(job) for job in jobs}
    arrivals = sorted(outcomes.items(), key=lambda item: (item[1].job.arrival, item[1].job.index))
    ends: list[tuple[datetime, str]] = []
    at = 0

    def seconds(moment: datetime) -> float:
        return (moment - START).total_seconds()

    def cycle(now: datetime) -> None:
        for job_id in service.cycles(now):
            outcome = outcomes[job_id]
            outcome.start = seconds(now)
            end = now + timedelta(seconds=max(outcome.job.limit - margin, 1))
            outcome.end = seconds(end)
            heapq.heappush(ends, (end, job_id))

    while at < len(arrivals) or ends:
        arriving = START + timedelta(seconds=arrivals[at][1].job.arrival) if at < len(arrivals) else None
        now = min(moment for moment in (arriving, ends[0][0] if ends else None) if moment is not None)
        if ends and ends[0][0] <= now:  # jobs end first, and the cycle the service runs then
            while ends and ends[0][0] <= now:
                _, job_id = heapq.heappop(ends)
                service.record(JobSucceeded(job_id=job_id), now, "job", job_id)
            cycle(now)
        while at < len(arrivals) and arrivals[at][1].job.arrival <= seconds(now):
            job_id, outcome = arrivals[at]
            at += 1
            spec = spec_of(outcome.job)
            told = service.predict(spec, now).prediction
            outcome.submitted = seconds(now)
            outcome.waits = not told.starts_now
            outcome.estimate = (seconds(told.estimated_start) if told.estimated_start is not None else None) \
                if outcome.waits else seconds(told.predicted_at)
            service.record(JobSubmitted(job_id=job_id, spec=spec, creator="bench"), now, "job", job_id)
            cycle(now)
    for outcome in outcomes.values():
        outcome.state = "COMPLETED" if outcome.end is not None else "NEVER STARTED"
    return list(outcomes.values())


# --- Slurm: the same trace in real time ---------------------------------------------------------------------------


def slurm_parameters(bf_resolution: int) -> list[str]:
    return [*BACKFILL, f"bf_resolution={bf_resolution}"]


@dataclass
class SlurmRun:
    """The trace on a Slurm peer in real time; `outcomes` in seconds after `origin` (seconds since the epoch)."""

    peer: SlurmPeer
    jobs: Sequence[TraceJob]
    margin: int = 2
    name: str = "est"
    progress: Callable[[str], None] = print
    origin: int = 0
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # by Slurm job id
    returned: dict[str, float] = field(default_factory=dict)  # when each job's sbatch returned
    answering: set[str] = field(default_factory=set)  # jobs submitted that have no answer yet
    settling: set[str] = field(default_factory=set)  # jobs told to wait, until SETTLE_SECONDS after submission
    lags: list[float] = field(default_factory=list)  # sbatch returned -> first seen running, jobs started at once

    def run(self) -> list[Outcome]:
        pending = sorted(self.jobs, key=lambda job: (job.arrival, job.index))
        stall = max(job.limit for job in self.jobs) + STALL_SECONDS
        self.origin = math.ceil(time.time()) + 1  # a whole second, as Slurm's times are
        time.sleep(max(0.0, self.origin - time.time()))
        last_report = last_change = 0.0
        seen: tuple[tuple[str, str], ...] = ()
        while True:
            now = time.time() - self.origin
            while pending and pending[0].arrival <= now:
                job = pending.pop(0)
                job_id = self.peer.submit(self.name, f"sleep {max(job.limit - self.margin, 1)}", nodes=job.nodes,
                                          cpus=job.cpus, memory_mib=job.memory_mib, minutes=job.minutes)
                self.returned[job_id] = time.time() - self.origin
                self.outcomes[job_id] = Outcome(job, submitted=float(job.arrival))
                self.answering.add(job_id)
            listed = self.peer.jobs(self.name)
            looked = time.time() - self.origin
            self.update(listed, looked)
            states = tuple(sorted((j.job_id, j.state) for j in listed))
            if states != seen or (pending and pending[0].arrival <= looked + 1):
                seen, last_change = states, looked
            elif looked - last_change > stall:
                raise RuntimeError(f"no Slurm job changed state for {stall:.0f} s; logs in {self.peer.folder / 'log'}")
            if looked - last_report >= PROGRESS_SECONDS:
                last_report = looked
                self.progress(self._progress(looked, listed))
            if not pending and len(self.outcomes) == len(self.jobs) and all(
                    o.state in ENDED for o in self.outcomes.values()):
                break
            poll = FAST_POLL if self.answering or self.settling else SLOW_POLL
            until = min(looked + poll, pending[0].arrival if pending else math.inf)
            time.sleep(max(0.0, until - (time.time() - self.origin)))
        self.progress(self._progress(time.time() - self.origin, listed))
        return [self.outcomes[job_id] for job_id in sorted(self.outcomes, key=lambda i: self.outcomes[i].job.index)]

    def update(self, listed: Sequence[JobTimes], looked: float) -> None:
        """Take in what `squeue` listed at `looked` (seconds after the origin)."""
        for times in listed:
            job_id, outcome = times.job_id, self.outcomes.get(times.job_id)
            if outcome is None:
                continue
            outcome.state = times.state
            if times.submitted is not None:
                outcome.submitted = float(times.submitted - self.origin)
            running = times.state != "PENDING"  # started (configuring, running, completing or ended)
            if running and times.start is not None:
                outcome.start = float(times.start - self.origin)
                outcome.nodes = times.nodes
            if times.state in ENDED and times.end is not None:
                outcome.end = float(times.end - self.origin)
            shown = None if running or times.start is None else float(times.start - self.origin)
            age = looked - self.returned[job_id]
            if job_id in self.answering:
                if running:  # found running before any estimate: it started at its submission
                    outcome.waits, outcome.estimate = False, outcome.start
                    self.lags.append(age)
                elif shown is not None:  # pending, with what `squeue --start` shows
                    outcome.waits, outcome.estimate, outcome.planned = True, shown, times.planned
                    self.settling.add(job_id)
                elif age > CAPTURE_SECONDS:
                    outcome.waits = True  # pending, and still no estimate
                if outcome.waits is not None:
                    outcome.answered_after = age
                    self.answering.discard(job_id)
            elif job_id in self.settling and (running or age >= SETTLE_SECONDS):
                # What it shows once a backfill pass has surely seen it (the first answer, if it started before).
                outcome.later = shown if shown is not None else outcome.estimate
                self.settling.discard(job_id)

    def _progress(self, now: float, listed: Sequence[JobTimes]) -> str:
        states = [j.state for j in listed]
        done = sum(1 for s in states if s in ENDED)
        return (f"[{now:6.0f} s] submitted {len(self.outcomes)} of {len(self.jobs)}, running "
                f"{states.count('RUNNING') + states.count('COMPLETING')}, pending {states.count('PENDING')}, "
                f"ended {done}")


def slurm_lags(outcomes: Sequence[Outcome], lags: Sequence[float], margin: int) -> list[tuple[str, str]]:
    """Slurm's reaction times: submission to start of the jobs that started at once, end of a job to the start
    of a queued job that started then (within 5 s of the last end before it), and how long its jobs ran."""
    at_once = [o.start - o.submitted for o in outcomes if o.waits is False and o.start is not None
               and o.submitted is not None]
    ends = sorted(o.end for o in outcomes if o.end is not None)
    after_end = []
    for o in outcomes:
        if not o.waits or o.start is None:
            continue
        before = [end for end in ends if end <= o.start]
        if before and o.start - before[-1] <= 5:
            after_end.append(o.start - before[-1])
    ran = [o.end - o.start - o.job.limit for o in outcomes if o.end is not None and o.start is not None]
    answered = [o.answered_after for o in outcomes if o.waits and o.answered_after is not None
                and o.estimate is not None]
    planned = [o for o in outcomes if o.waits and o.planned and o.nodes]

    def spread(values: Sequence[float], unit: str = "s") -> str:
        if not values:
            return "-"
        return (f"{statistics.median(values):.1f} / {_percentile(values, 0.9):.1f} / {max(values):.1f} {unit}"
                f" ({len(values)} jobs)")

    return [
        ("submission to start, jobs that started at once (Slurm's times)", spread(at_once)),
        ("  sbatch returned to first seen running (polled)", spread(lags)),
        ("end of a job to the start of a queued job then", spread(after_end)),
        ("submission to the estimate shown, queued jobs (polled)", spread(answered)),
        (f"ran: end - start - limit (the script sleeps limit - {margin} s)", spread(ran)),
        ("queued jobs that ran on the nodes their first estimate planned",
         f"{sum(1 for o in planned if o.planned == o.nodes)} of {len(planned)}"),
    ]


# --- the report ---------------------------------------------------------------------------------------------------


def table(columns: Sequence[tuple[str, list[tuple[str, str]]]]) -> str:
    """Rows side by side, the labels of the first column's rows."""
    labels = [label for label, _ in columns[0][1]]
    width = max(len(label) for label in labels)
    widths = [max(len(title), *(len(value) for _, value in values)) for title, values in columns]
    lines = ["".ljust(width) + "".join(f"  {title.ljust(w)}" for (title, _), w in zip(columns, widths, strict=True))]
    for index, label in enumerate(labels):
        lines.append(label.ljust(width) + "".join(
            f"  {values[index][1].ljust(w)}" for (_, values), w in zip(columns, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


def compare_starts(ours: Sequence[Outcome], theirs: Sequence[Outcome]) -> str:
    """How far apart the two systems started the same jobs."""
    pairs = [(a.start, b.start) for a, b in zip(ours, theirs, strict=True) if a.start is not None
             and b.start is not None]
    if not pairs:
        return ""
    gaps = [abs(a - b) for a, b in pairs]
    return (f"the same jobs' real starts, Trainyard against Slurm: median / p90 difference "
            f"{_seconds(statistics.median(gaps))} / {_seconds(_percentile(gaps, 0.9))}, "
            f"{sum(1 for g in gaps if g <= 10) / len(gaps):.0%} within 10 s")


def write_csv(path: Path, sides: Sequence[tuple[str, Sequence[Outcome]]]) -> None:
    """Every job of every side, one row each."""
    with path.open("w", newline="") as file:
        out = csv.writer(file)
        out.writerow(["side", "job", "arrival", "nodes", "cpus", "memory_mib", "minutes", "submitted", "waits",
                      "estimate", "later", "start", "end", "state", "answered_after", "planned_on", "ran_on"])
        for side, outcomes in sides:
            for o in outcomes:
                job = o.job
                out.writerow([side, job.index, job.arrival, job.nodes, job.cpus, job.memory_mib, job.minutes,
                              o.submitted, o.waits, o.estimate, o.later, o.start, o.end, o.state,
                              None if o.answered_after is None else round(o.answered_after, 2), o.planned, o.nodes])


def _stop_on_sigterm() -> None:
    """SIGTERM (and SIGHUP) end the run as Ctrl-C does, so that Slurm's daemons and folder go."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def run_slurm(jobs: Sequence[TraceJob], margin: int, bf_resolution: int) -> SlurmRun:
    """The trace on a Slurm peer of its own, in a folder of its own; both gone when it returns or raises."""
    with tempfile.TemporaryDirectory(prefix="trainyard-slurm-") as workdir:
        peer = SlurmPeer(Path(workdir), NODES, CPUS, MEMORY_MIB, scheduler_parameters=slurm_parameters(bf_resolution))
        print(f"{slurm_version()}: {peer.nodes} nodes of {peer.cpus} CPUs and {peer.memory_mib} MiB, "
              f"SchedulerType=sched/backfill, SchedulerParameters={','.join(peer.scheduler_parameters)}, "
              f"select/cons_tres CR_Core_Memory, priority/basic; jobs sleep their limit - {margin} s", flush=True)
        with peer:
            run = SlurmRun(peer, jobs, margin, progress=lambda line: print(line, flush=True))
            run.run()
        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=55, help="jobs in the trace (default 55)")
    parser.add_argument("--minutes", type=int, nargs=2, default=(1, 4), metavar=("LOW", "HIGH"),
                        help="time limits, whole minutes (default 1 4)")
    parser.add_argument("--load", type=float, default=0.9, help="offered load against the cluster's CPUs")
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--margin", type=int, default=2,
                        help="Slurm's jobs sleep this many seconds less than their limit (default 2)")
    parser.add_argument("--bf-resolution", type=int, default=1,
                        help="Slurm's bf_resolution, seconds (default 1; Slurm's own default is 60)")
    parser.add_argument("--quick", action="store_true", help="a 4-minute run: 8 jobs of 1-2 minutes")
    parser.add_argument("--no-slurm", action="store_true", help="Trainyard's side only")
    parser.add_argument("--csv", type=Path, help="write every job of every side to this CSV file")
    args = parser.parse_args()
    count, minutes = (QUICK["jobs"], QUICK["minutes"]) if args.quick else (args.jobs, tuple(args.minutes))
    assert isinstance(count, int) and isinstance(minutes, tuple)
    jobs = trace(count, random.Random(args.seed), load=args.load, minutes=(minutes[0], minutes[1]))
    print(f"{len(jobs)} jobs on {NODES} nodes of {CPUS} CPUs and {MEMORY_MIB} MiB, limits {minutes[0]}-{minutes[1]} "
          f"min, arrivals over {jobs[-1].arrival} s, offered load {offered_load(jobs):.0%} (asked {args.load:.0%}), "
          f"seed {args.seed}; {sum(1 for j in jobs if j.nodes > 1)} jobs of 2-4 whole nodes; "
          f"python {platform.python_version()} on {os.cpu_count()} CPUs ({platform.machine()})")
    began = time.perf_counter()
    exact = run_trainyard(jobs)
    early = run_trainyard(jobs, args.margin)
    print(f"Trainyard's side in virtual time: {time.perf_counter() - began:.1f} s for both plays\n")
    columns = [("Trainyard, to the limit", rows(exact)), (f"Trainyard, {args.margin} s early", rows(early))]
    sides: list[tuple[str, Sequence[Outcome]]] = [("trainyard", exact), ("trainyard-early", early)]
    extra: list[str] = []
    if not args.no_slurm:
        if (missing := slurm_missing()) is not None:
            raise SystemExit(missing)
        _stop_on_sigterm()
        try:
            run = run_slurm(jobs, args.margin, args.bf_resolution)
        except KeyboardInterrupt:
            print("interrupted: Slurm's daemons are stopped and its folder removed", file=sys.stderr)
            raise SystemExit(130) from None
        theirs = sorted(run.outcomes.values(), key=lambda o: o.job.index)
        later = [dataclasses.replace(o, estimate=o.later if o.later is not None else o.estimate) for o in theirs]
        columns += [("Slurm, first answer", rows(theirs)), (f"Slurm, {SETTLE_SECONDS:.0f} s later", rows(later))]
        sides.append(("slurm", theirs))
        extra = ["", "Slurm's reaction times, median / p90 / max:",
                 *(f"  {label}: {value}" for label, value in slurm_lags(theirs, run.lags, args.margin))]
        if (compared := compare_starts(early, theirs)):
            extra += ["", compared + " (Trainyard's jobs ending early as Slurm's do)"]
    if args.csv is not None:
        write_csv(args.csv, sides)
    print()
    print(table(columns))
    for line in extra:
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
