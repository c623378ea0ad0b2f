"""How long jobs really run, learned from finished jobs, for the likely start of a queued job (S6).

A duration limit is an upper bound: most jobs end well before it, and how far before depends on who
runs what. The model keeps, per group of similar jobs, the share of its limit each finished job used
(for a job without a limit, how long it ran), and estimates a job from the most specific group with
at least `min_samples` finished jobs:

1. the same user's jobs of the same kind (same project and name prefix: `resnet` for `resnet50-lr3`);
2. the same user's jobs with the same flavor and node count;
3. the same user's jobs;
4. the project's jobs;
5. jobs with the same flavor and node count;
6. all jobs.

A running job is compared only with finished jobs that ran longer than it has so far, so an estimate
is never below what a job already ran, and never above its limit. Without enough history a job runs
to its limit, and a job without a limit runs for good, as the latest start assumes.

The model is a fold over job ends (JobSucceeded, JobFailed, JobStopped, JobExpired, each with its
job's start and limit as the state knows them), so replaying the log rebuilds it. A group keeps its
last `window` samples, so the model follows changing habits.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

from libs.contracts.jobspec import JobSpec
from libs.placement import QueuedJob, RunningJob
from services.scheduler.planning.expected import Expected

Group = tuple[str, ...]


class JobRecord(Protocol):
    """What the model reads of a job (the scheduler state's Job has it)."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def creator(self) -> str: ...
    @property
    def flavor(self) -> str | None: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def ended_at(self) -> datetime | None: ...
    @property
    def duration_seconds(self) -> int | None: ...


_KIND = re.compile(r"[a-z]+")


def kind_of(name: str) -> str:
    """The leading letters of a job name, which usually name what it runs: `resnet50-lr3` -> `resnet`."""
    match = _KIND.match(name.lower())
    return match.group(0) if match else name.lower()


class Traits(NamedTuple):
    """What makes jobs alike in how long they run (a tuple: one is made, hashed and compared for every queued
    job of every plan)."""

    creator: str  # "" when unknown
    project: str
    kind: str
    flavor: str
    nodes: int

    @classmethod
    def of(cls, spec: JobSpec, creator: str = "", flavor: str | None = None) -> Traits:
        """A job's traits; `flavor` is the one it runs with (default: the first it lists)."""
        return cls(creator, spec.project, kind_of(spec.name), flavor or (spec.flavors[0] if spec.flavors else ""),
                   spec.nodes)

    @property
    def groups(self) -> tuple[Group, ...]:
        """The groups it belongs to, most specific first."""
        shape = (self.flavor, str(self.nodes))
        own: tuple[Group, ...] = ()
        if self.creator:
            own = (("kind", self.creator, self.project, self.kind), ("user-shape", self.creator, *shape),
                   ("user", self.creator))
        return (*own, ("project", self.project), ("shape", *shape), ("all",))


class _Samples:
    """The last values of one group, with their mean above any floor in logarithmic time."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._tails: list[float] = []  # _tails[i]: sum of _sorted[i:]
        self._stale = False

    def add(self, value: float) -> None:
        self.values.append(value)
        self._stale = True

    def above(self, floor: float) -> tuple[int, float]:
        """How many values exceed `floor`, and their mean."""
        if self._stale:
            self._sorted = sorted(self.values)
            self._tails = [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                self._tails[i] = self._tails[i + 1] + self._sorted[i]
            self._stale = False
        i = bisect.bisect_right(self._sorted, floor)
        count = len(self._sorted) - i
        return count, self._tails[i] / count if count else 0.0


class RuntimeModel:
    def __init__(self, *, window: int = 200, min_samples: int = 5) -> None:
        self.window = window
        self.min_samples = min_samples
        self.observed = 0
        self._shares: dict[Group, _Samples] = {}  # jobs with a limit: runtime / limit
        self._seconds: dict[Group, _Samples] = {}  # jobs without one: runtime in seconds
        self._fresh: dict[tuple[Traits, int | None], float | None] = {}  # estimates of jobs yet to start

    def job_ended(self, job: JobRecord) -> None:
        """Learn from a job that has just ended (one that never started teaches nothing)."""
        if job.started_at is None or job.ended_at is None:
            return
        self.observe(Traits.of(job.spec, job.creator, job.flavor), job.duration_seconds,
                     (job.ended_at - job.started_at).total_seconds())

    def observe(self, traits: Traits, limit: int | None, runtime: float) -> None:
        """A finished job of `traits` with duration limit `limit` (seconds; None: none) ran `runtime` seconds."""
        runtime = max(runtime, 0.0)
        if limit is None:
            table, value = self._seconds, runtime
        else:  # a job stopped at its limit takes a moment to end: count it as running to the limit
            table, value = self._shares, min(runtime / limit, 1.0) if limit > 0 else 1.0
        for group in traits.groups:
            samples = table.get(group)
            if samples is None:
                samples = table[group] = _Samples(self.window)
            samples.add(value)
        self.observed += 1
        self._fresh.clear()

    def runtime(self, traits: Traits, limit: int | None, elapsed: float = 0.0) -> float | None:
        """The likely runtime in seconds of a job that has run for `elapsed` seconds: at least `elapsed`,
        at most `limit`; the limit without enough history, and None (runs for good) for a job without
        a limit and without history."""
        if elapsed > 0:
            return self._runtime(traits, limit, elapsed)
        key = (traits, limit)
        if key not in self._fresh:
            self._fresh[key] = self._runtime(traits, limit, 0.0)
        return self._fresh[key]

    def _runtime(self, traits: Traits, limit: int | None, elapsed: float) -> float | None:
        if limit is None:
            seconds = self._mean_above(self._seconds, traits, elapsed)
            return None if seconds is None else max(seconds, elapsed)
        share = self._mean_above(self._shares, traits, elapsed / limit if limit > 0 else 1.0)
        return float(limit) if share is None else min(max(share * limit, elapsed), float(limit))

    def _mean_above(self, table: dict[Group, _Samples], traits: Traits, floor: float) -> float | None:
        for group in traits.groups:
            samples = table.get(group)
            if samples is not None:
                count, mean = samples.above(floor)
                if count >= self.min_samples:
                    return mean
        return None

    def history(self) -> dict[str, dict[Group, list[float]]]:
        """Every group's samples (to compare two models)."""
        return {"shares": {g: list(s.values) for g, s in self._shares.items()},
                "seconds": {g: list(s.values) for g, s in self._seconds.items()}}


def expected_runtimes(model: RuntimeModel, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
                      jobs: Mapping[str, JobRecord], now: datetime) -> Expected:
    """When the running jobs will likely end and how long the queued ones will likely run, where that
    differs from their duration limits. `jobs` says who submitted each job and when it started."""
    ends: dict[str, datetime | None] = {}
    for holder in running:
        record = jobs.get(holder.job_id)
        if record is None or (holder.ends_at is not None
                              and (holder.ends_at <= now or record.duration_seconds is None)):
            continue  # unknown, being stopped at its limit, or a limit the record does not know
        start = record.started_at or now  # a job being pre-checked has not started yet
        limit = None if holder.ends_at is None else record.duration_seconds
        seconds = model.runtime(Traits.of(record.spec, record.creator, holder.flavor.name), limit,
                                max((now - start).total_seconds(), 0.0))
        end = None if seconds is None else start + timedelta(seconds=seconds)
        if end is not None and holder.ends_at is not None:
            end = min(end, holder.ends_at)
        if end != holder.ends_at:
            ends[holder.job_id] = end
    durations: dict[str, int | None] = {}
    for job in queue:
        record = jobs.get(job.job_id)
        likely = model.runtime(Traits.of(job.spec, record.creator if record else ""), job.duration_seconds)
        seconds = None if likely is None else math.ceil(likely)
        if seconds != job.duration_seconds:
            durations[job.job_id] = seconds
    return Expected(ends=ends, seconds=durations)
