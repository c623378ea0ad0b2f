"""The scheduler in virtual time: its own cycle played forward from one state (SPEC S6).

A simulation starts from what a cycle sees (the nodes and what is free on them, the running jobs, the
queue in start order) and, at every instant something changes, runs the scheduler's cycle on the queue as
it is then: `libs.placement.schedule` on the first `CYCLE_DEPTH` waiting jobs, as `cycle.decide` does. What
the cycle admits starts then. The simulation then jumps to the next instant a
job ends or is submitted. There is no second model of the policy: whatever the cycle decides, happens.

Each job has two times. Its duration limit is all the scheduler knows: reservations and backfill are
decided on it. Its runtime is when it really ends in the simulation: the limit when nothing better is
known, a likely runtime (runtime_model.py), or, replaying history, what it really ran (never past its
limit, where it is stopped, J16). A job with neither holds its nodes for good.

Between two such instants nothing can start: with nothing else changed, a later `now` only makes a cycle's
decision harder (a backfill must end before the head's reserved start, and ends sooner the earlier it
starts; an admitted job holds its nodes until a later end). So the simulation skips them, and a job's
simulated start is exactly the instant the real scheduler starts it when the jobs run as simulated and
nothing else happens (tests/unit/test_simulation.py holds it to that, against the scheduler's own fold).

Not simulated (yet): the growth of shrunken elastic jobs (S10: a job keeps the nodes it runs on), array `%N`
caps (the held-back members join as if uncapped), pre-checks of checkpoint-resume jobs (admitted is started),
and the moves of faults. Nothing here reads a clock or
does I/O: `now` is a parameter, and the result is a function of the inputs.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import PRIORITY_RANK, Priority
from libs.placement import CYCLE_DEPTH, Cluster, Cycle, Decision, NodeCapacity, QueuedJob, RunningJob

# Cycles run at one instant at most: after its own admissions the scheduler runs another cycle, which
# usually admits nothing.
_CYCLES_PER_INSTANT = 8


@dataclass(frozen=True)
class Arrival:
    """A job submitted at `at` (a replay's history, or a what-if's extra load)."""

    at: datetime
    job: QueuedJob
    runtime: int | None = None  # seconds it runs once started; None: until its limit


@dataclass(frozen=True)
class Started:
    """A job's start in the simulation."""

    job_id: str
    at: datetime
    flavor: str
    placement: list[Placement]
    backfilled: bool = False  # started ahead of a job waiting before it
    ends_at: datetime | None = None  # when it ends in the simulation; None: never
    # The jobs whose end at `at` let it start: those that ended then on its nodes, else all that ended then.
    waits_for: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """One cycle of a simulation, kept for a job that might join the queue (`Simulation(joins=...)`): the cycle
    stopped where a job of each priority would join (None: past the cycle's depth), and the simulation as it
    was before the first cycle of the instant, to go on from with such a job."""

    at: datetime
    joins: Mapping[Priority, Cycle | None]
    ended: Mapping[str, frozenset[str]]  # the jobs that ended at `at`, and their nodes
    before: Simulation


def insertion_index(queue: Sequence[QueuedJob], priority: Priority) -> int:
    """Where a new job of `priority` joins the queue: behind every job of the same or a higher priority (S1). The
    queue is in start order, so its priorities never rise: a binary search finds the place."""
    return bisect.bisect_right(queue, PRIORITY_RANK[priority], key=_rank)


def _rank(job: QueuedJob) -> int:
    return PRIORITY_RANK[job.spec.priority]


def waits_for(ended: Mapping[str, frozenset[str]], placement: Sequence[Placement]) -> list[str]:
    """The jobs whose end let a job start on `placement`: those that ended then on its nodes, else all that did."""
    nodes = {p.node for p in placement}
    return sorted({job_id for job_id, held in ended.items() if not held.isdisjoint(nodes)} or ended)


@dataclass
class Outcome:
    """What a simulation found: who started when, who ended when, and who never started and why."""

    started: dict[str, Started]
    ended: dict[str, datetime]
    waiting: list[str]  # still queued when the simulation stopped, in start order
    unplaceable: set[str]  # fit on no node of the cluster even when it is empty
    now: datetime  # where virtual time stopped
    cycles: int  # cycles run


class Simulation:
    """The scheduler's cycle played forward in virtual time (see the module's description)."""

    def __init__(self, nodes: Sequence[NodeCapacity], flavors: Mapping[str, Flavor], *,
                 running: Iterable[RunningJob] = (), queue: Iterable[QueuedJob] = (), now: datetime,
                 ends: Mapping[str, datetime | None] | None = None, runtimes: Mapping[str, int | None] | None = None,
                 arrivals: Iterable[Arrival] = (), depth: int = CYCLE_DEPTH, joins: Collection[Priority] = ()) -> None:
        """`ends`: when running jobs really end (default: at their limits); `runtimes`: how long queued jobs
        run once started (default: their limits); `joins`: the priorities of jobs that might join, for whom
        each cycle is kept (`steps`)."""
        self.infos = [n.info for n in nodes]
        self.cluster = Cluster(self.infos)
        self.free: dict[str, Resources] = {n.info.name: n.free for n in nodes}
        self.flavors = dict(flavors)
        self.now = now
        self.depth = depth
        self.queue: list[QueuedJob] = list(queue)
        self.running: dict[str, RunningJob] = {}
        self.runtimes: dict[str, int | None] = dict(runtimes or {})
        self._shared_runtimes = False
        self.joins = tuple(joins)
        self.steps: list[Step] = []
        self._order = itertools.count()
        self._ends: list[tuple[datetime, int, str]] = []
        self._arrivals: list[tuple[datetime, int, Arrival]] = []
        self._ended_now: dict[str, frozenset[str]] = {}  # the jobs that ended at `now`, and their nodes
        self._decided = False  # the cycles at `now` have run
        self.started: dict[str, Started] = {}
        self.ended: dict[str, datetime] = {}
        # A job no node could take (by pool or pinning) fits on no node, though no cycle looks at it: known at once.
        self.unplaceable: set[str] = {job.job_id for job in self.queue if not self.cluster.served.may_serve(job.spec)}
        self.cycles = 0
        ends = ends or {}
        for job in running:
            self.running[job.job_id] = job.changed(can_grow=False) if job.can_grow else job  # growth: not simulated
            end = ends.get(job.job_id, job.ends_at)
            if end is not None:
                heapq.heappush(self._ends, (max(end, now), next(self._order), job.job_id))
        for arrival in arrivals:
            heapq.heappush(self._arrivals, (arrival.at, next(self._order), arrival))

    def fork(self) -> Simulation:
        """An independent copy to go on with, as far as this one has gone, without its history (what started and
        ended so far) or its kept cycles."""
        twin = copy.copy(self)
        twin.free, twin.running, twin.queue = dict(self.free), dict(self.running), list(self.queue)
        self._shared_runtimes = twin._shared_runtimes = True  # copied by the first to add to them
        twin._order = itertools.count(next(self._order))
        twin._ends, twin._arrivals = list(self._ends), list(self._arrivals)
        twin.started, twin.ended, twin.unplaceable = {}, {}, set(self.unplaceable)
        twin.steps, twin.joins = [], ()
        return twin

    def add(self, job: QueuedJob, runtime: int | None = None) -> None:
        """`job` in the queue as if it had been there all along, behind every job of its priority or higher. Before
        the cycles of `now` have run, that is exact; after, only when none of the cycles so far would have started
        it or made it the head (the caller checked that on `steps`)."""
        self._join(Arrival(self.now, job, runtime))

    # --- running --------------------------------------------------------------------------------------

    def run(self, *, until: Collection[str] = (), max_cycles: int | None = None) -> Outcome:
        """Play forward until every job of `until` started (when given), nothing more can change, or
        `max_cycles` cycles have run."""
        wanted = set(until)
        self.decide()
        while not (wanted and wanted <= self.started.keys()):
            instant = self.next_instant()
            if instant is None:
                break
            if max_cycles is not None and self.cycles >= max_cycles:
                break
            self.advance(instant)
            self.decide()
        return self.outcome()

    def outcome(self) -> Outcome:
        return Outcome(started=dict(self.started), ended=dict(self.ended),
                       waiting=[job.job_id for job in self.queue], unplaceable=set(self.unplaceable),
                       now=self.now, cycles=self.cycles)

    def ending(self) -> dict[str, datetime]:
        """When each running job with an end ends."""
        return {job_id: end for end, _, job_id in self._ends if job_id in self.running}

    def runtime(self, job: QueuedJob) -> int | None:
        """How long a queued job runs once started: its runtime, never past its limit (None: for good)."""
        limit = job.duration_seconds
        runtime = self.runtimes.get(job.job_id, limit)
        return runtime if limit is None else limit if runtime is None else min(runtime, limit)

    def next_instant(self) -> datetime | None:
        """When something next changes: a job ends or is submitted. None: never."""
        times = [heap[0][0] for heap in (self._ends, self._arrivals) if heap]
        return min(times) if times else None

    def advance(self, instant: datetime) -> None:
        """Virtual time moves to `instant`: the jobs ending then give their nodes back, those submitted
        then join the queue. The cycles of `instant` are still to run (`decide`)."""
        self.now, self._decided = instant, False
        self._ended_now = {}
        while self._ends and self._ends[0][0] <= instant:
            _, _, job_id = heapq.heappop(self._ends)
            job = self.running.pop(job_id, None)
            if job is None:
                continue
            held = job.held
            for name, amount in held.items():
                if name in self.free:
                    self.free[name] = self.free[name] + amount
            self.ended[job_id] = instant
            self._ended_now[job_id] = frozenset(held)
        while self._arrivals and self._arrivals[0][0] <= instant:
            _, _, arrival = heapq.heappop(self._arrivals)
            self._join(arrival)

    def _join(self, arrival: Arrival) -> None:
        """A job joins the queue behind every job of its priority or higher (S1)."""
        job = arrival.job
        if self._shared_runtimes:
            self.runtimes, self._shared_runtimes = dict(self.runtimes), False
        self.runtimes[job.job_id] = arrival.runtime
        self.queue.insert(insertion_index(self.queue, job.spec.priority), job)
        if not self.cluster.served.may_serve(job.spec):
            self.unplaceable.add(job.job_id)

    # --- one instant ------------------------------------------------------------------------------------

    def decide(self) -> None:
        """The scheduler's cycles at `now` (once), until one starts nothing."""
        if self._decided:
            return
        before = self.fork() if self.joins else None
        self._decided = True
        for _ in range(_CYCLES_PER_INSTANT):
            if not self.queue and not self.joins:
                return  # (kept for a job that might join, even a cycle over an empty queue)
            decision = self._cycle(before)
            self.unplaceable.update(decision.unplaceable)
            if not decision.admissions:
                return
            admitted = {admission.job_id: admission for admission in decision.admissions}
            for job in self.queue:
                if (admission := admitted.get(job.job_id)) is not None:
                    self._start(job, admission.flavor, admission.placement, admission.backfilled)
            self.queue = [job for job in self.queue if job.job_id not in admitted]

    def _cycle(self, before: Simulation | None) -> Decision:
        """One cycle, as `cycle.decide` runs it: `schedule` over the first `depth` waiting jobs some node could take.
        With `joins`, it is stopped and copied where a job of each of those priorities would join."""
        served = self.cluster.served
        window = list(itertools.islice((job for job in self.queue if served.may_serve(job.spec)), self.depth))
        nodes = [NodeCapacity(info=info, free=self.free[info.name]) for info in self.infos]
        cycle = Cycle(nodes, self.flavors, list(self.running.values()), self.now, cluster=self.cluster)
        self.cycles += 1
        if before is None:
            return cycle.run(window)
        places = {priority: index for priority in self.joins
                  if (index := insertion_index(window, priority)) < self.depth}
        stops: dict[int, Cycle] = {}
        done = 0
        for index in sorted(set(places.values())):
            cycle.run(window[done:index], grow=False)
            stops[index], done = cycle.fork(), index
        decision = cycle.run(window[done:])
        joins = {priority: stops[places[priority]] if priority in places else None for priority in self.joins}
        self.steps.append(Step(at=self.now, joins=joins, ended=dict(self._ended_now), before=before))
        return decision

    def _start(self, job: QueuedJob, flavor_name: str, placement: list[Placement], backfilled: bool) -> None:
        flavor = self.flavors[flavor_name]
        limit = job.duration_seconds
        runtime = self.runtime(job)  # never past its limit: stopped there (J16)
        limit_end = None if limit is None else self.now + timedelta(seconds=limit)
        end = None if runtime is None else self.now + timedelta(seconds=runtime)
        running = RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=placement, ends_at=limit_end,
                             excluded_nodes=job.excluded_nodes)
        self._take(running.held)
        self.running[job.job_id] = running
        if end is not None:
            heapq.heappush(self._ends, (end, next(self._order), job.job_id))
        self.started[job.job_id] = Started(job_id=job.job_id, at=self.now, flavor=flavor_name, placement=placement,
                                           backfilled=backfilled, ends_at=end,
                                           waits_for=waits_for(self._ended_now, placement))

    def _take(self, held: Mapping[str, Resources]) -> None:
        for name, amount in held.items():
            if name in self.free:
                self.free[name] = self.free[name] - amount


def simulate(nodes: Sequence[NodeCapacity], flavors: Mapping[str, Flavor], *, running: Iterable[RunningJob] = (),
             queue: Iterable[QueuedJob] = (), now: datetime, until: Collection[str] = (),
             ends: Mapping[str, datetime | None] | None = None, runtimes: Mapping[str, int | None] | None = None,
             arrivals: Iterable[Arrival] = (), max_cycles: int | None = None) -> Outcome:
    """One simulation from the given state (see `Simulation`)."""
    return Simulation(nodes, flavors, running=running, queue=queue, now=now, ends=ends, runtimes=runtimes,
                      arrivals=arrivals).run(until=until, max_cycles=max_cycles)
