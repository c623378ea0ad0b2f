"""Queue predictions from the scheduler's own cycles played forward (SPEC S6, simulation.py).

A `Playthrough` is one state's queue played forward in virtual time, only as far as the questions asked
need, and kept: for the jobs queued, when each starts; for a new job of any priority, when it would start.
Twice per state: the *latest* start, with every job running to its duration limit, and the *likely* start,
with the runtimes the runtime model expects (the scheduler still decides on the limits, which is all it
knows).

A new job asks without the queue being played again. Each cycle of the playthrough is kept stopped where a
job of each priority would join it. At each cycle in turn the new job is tried there, on a copy: if the
cycle would start it, that is its start; if it would neither start it nor make it the first waiting job
(the head, whose reservation changes what happens behind it), it took nothing and the cycle would have
decided the rest as it did, so the next cycle is tried. When it would become the head, the playthrough goes
on from just before that instant with the job in the queue. A job submitted while a playthrough is kept is
taken into it the same way (`join`): the cycles before it would start or lead stand.

A playthrough is bounded (`cycle_bound`): it runs at most `SIMULATION_NODE_CYCLES` divided by the number of nodes
cycles, and `SIMULATION_JOB_CYCLES` divided by the waiting jobs a cycle looks at (rounded up to a power of two): a
cycle's cost grows with both. The bound counts cycles, which are the same however a job submitted meanwhile was
taken in, so a kept playthrough stops where a fresh one would, as long as the jobs taken in leave the bound as it
was (the prediction cache makes its plan again when one would not). Past it, the jobs not started yet are planned
from the state the simulation reached by the conservative backfill plan (backfill_plan.py), which is cheaper and
never later than it should be by more than the scheduler's own extra backfilling: exact where the cluster is small
enough, an estimate beyond (docs/simulation.md says how close, from `bench.prediction_accuracy`). That plan places
at most `HORIZON_NODE_JOBS` divided by the number of nodes jobs one by one (`Horizon`); the jobs behind them get a
rough start from the room it leaves (fluid_plan.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from libs.contracts.cluster import Flavor
from libs.contracts.jobspec import Priority
from libs.placement import CYCLE_DEPTH, Capacity, Cycle, Decision, NodeCapacity, QueuedJob, RunningJob, choose
from services.scheduler.planning.backfill_plan import Plan, Planner
from services.scheduler.planning.fluid_plan import FluidPlan
from services.scheduler.planning.simulation import Simulation, Started, Step, insertion_index, waits_for

# Cycles times nodes one playthrough may run (see the module): 8 cycles on 1,000 nodes, 80 on 100, at some 15 µs
# per node and waiting job looked at on this machine; 160 on 100 nodes were barely more exact (docs/benchmarks.md).
SIMULATION_NODE_CYCLES = 8_000
# Cycles times waiting jobs looked at (a power of two) one playthrough may run: 64 cycles with 1,000 waiting, at some
# 2 to 3 µs a waiting job looked at. Without it a small cluster with a deep queue played a cycle for nearly every job
# ending (8 nodes: 1,000 cycles over 800 jobs, 2.3 s a plan: `bench.throughput`'s scheduler spent most of its time
# there).
SIMULATION_JOB_CYCLES = 65_536
# Jobs times nodes the conservative plan past the playthrough places one by one (Horizon): 250 jobs on 1,000
# nodes, at some 500 µs a job there; the jobs behind them get a rough, fluid estimate (fluid_plan.py).
HORIZON_NODE_JOBS = 250_000
PRIORITIES: tuple[Priority, ...] = ("very-urgent", "urgent", "normal")


def cycle_bound(nodes: int, waiting: int) -> int:
    """The cycles a playthrough of `waiting` jobs on `nodes` nodes may run (see the module)."""
    looked_at = 1 << (max(1, min(waiting, CYCLE_DEPTH)) - 1).bit_length()
    return max(1, min(SIMULATION_NODE_CYCLES // max(1, nodes), SIMULATION_JOB_CYCLES // looked_at))


class Playthrough:
    """One state's queue played forward by the scheduler's cycles, as far as needed (see the module)."""

    def __init__(self, nodes: Sequence[NodeCapacity], flavors: Mapping[str, Flavor], *,
                 running: Sequence[RunningJob] = (), queue: Sequence[QueuedJob] = (), now: datetime,
                 ends: Mapping[str, datetime | None] | None = None, runtimes: Mapping[str, int | None] | None = None,
                 max_cycles: int | None = None) -> None:
        """`ends`: when running jobs end (default: their limits); `runtimes`: how long queued jobs run; `max_cycles`:
        the bound (default: from `SIMULATION_NODE_CYCLES`)."""
        self.max_cycles = cycle_bound(len(nodes), len(queue)) if max_cycles is None else max_cycles
        self.simulation = Simulation(nodes, flavors, running=running, queue=queue, now=now, ends=ends,
                                     runtimes=runtimes, joins=PRIORITIES)
        self.simulation.decide()
        self.steps: list[Step] = []  # the kept cycles of the simulations before the current one
        self.carried: dict[str, Plan] = {}  # the starts found by the simulations before the current one
        self.joined: list[tuple[QueuedJob, int | None]] = []  # jobs submitted since, and their runtimes
        self.horizon: Horizon | None = None  # the conservative plan from where the simulation stopped at its bound

    # --- the jobs queued ---------------------------------------------------------------------------------

    def queued(self, job_ids: Collection[str]) -> dict[str, Plan]:
        """The plan of each of `job_ids` that is queued in the state played."""
        missing = {job_id for job_id in job_ids if job_id not in self.carried}
        started = self.simulation.started
        missing.difference_update(started)
        while missing and self._extend():
            missing.difference_update(started)
        plans = {job_id: self.carried[job_id] for job_id in job_ids if job_id in self.carried}
        plans.update((job_id, _plan_of(started[job_id])) for job_id in job_ids if job_id in started)
        left = [job for job in self.simulation.queue if job.job_id in missing]
        if left:
            plans.update(self._beyond(left, self.simulation))
        return plans

    # --- a new job ---------------------------------------------------------------------------------------

    def new_job(self, job: QueuedJob, runtime: int | None = None) -> Plan:
        """When `job`, joining the queue now, would start (it runs `runtime` seconds; None: to its limit)."""
        found = self._find(job)
        if isinstance(found, Plan):
            return found
        if found is None:  # neither started nor led within the playthrough
            if self.simulation.next_instant() is not None:  # it stopped at its bound: the conservative plan goes on
                return self._horizon().new_job(_as_planned(job, runtime))
            simulation = self.simulation.fork()
            simulation.add(job, runtime)
            return self._never(job, simulation)
        with_it = self._resumed(found.before)
        with_it.add(job, runtime)
        with_it.run(until={job.job_id}, max_cycles=self.max_cycles)
        if (start := with_it.started.get(job.job_id)) is not None:
            return _plan_of(start)
        return self._beyond([job], with_it)[job.job_id]

    def join(self, job: QueuedJob, runtime: int | None = None) -> None:
        """`job` was submitted into the state this playthrough plays: from the first instant at which a cycle would
        start it or make it the head, it is played again with the job queued."""
        found = self._find(job)
        self.joined.append((job, runtime))
        if found is None or (isinstance(found, Plan) and found.start is None):
            self.simulation.add(job, runtime)  # no cycle so far would have started it or made it the head
            if found is not None:  # it fits on no node: known now, though no cycle may run again to find it
                self.simulation.unplaceable.add(job.job_id)
            if self.horizon is not None:
                self.horizon.join(_as_planned(job, runtime), unplaceable=found is not None)
            return
        self.horizon = None  # played again from before the bound
        at = found.at if isinstance(found, Step) else found.start
        assert at is not None  # a plan without a start returned above
        steps = self._steps()
        index = next(i for i, step in enumerate(steps) if step.at >= at)  # the instant's first cycle
        before = steps[index].before
        self.carried = self._started_before(before.now)
        simulation = self._resumed(before)  # with the job too
        simulation.joins = PRIORITIES
        self.steps, self.simulation = steps[:index], simulation
        simulation.decide()

    def _resumed(self, before: Simulation) -> Simulation:
        """A copy of a kept simulation to go on from, with the jobs joined since it was kept queued in it (those
        that had not started by then: each was played again from before it would start)."""
        simulation = before.fork()
        known = {job.job_id for job in simulation.queue}.union(simulation.running, self._started_before(before.now))
        for job, runtime in self.joined:
            if job.job_id not in known:
                simulation.add(job, runtime)
        return simulation

    def _started_before(self, moment: datetime) -> dict[str, Plan]:
        """The plans found so far of the jobs that start before `moment`."""
        found = {**self.carried, **{job_id: _plan_of(start) for job_id, start in self.simulation.started.items()}}
        return {job_id: plan for job_id, plan in found.items() if plan.start is not None and plan.start < moment}

    def _find(self, job: QueuedJob) -> Plan | Step | None:
        """The plan of `job` when a kept cycle would start it (or it fits on no node), the step at which it would
        become the head, or None when neither happens within the playthrough."""
        priority = job.spec.priority
        index = 0
        while True:
            if index < len(self.steps):
                step = self.steps[index]
            elif index - len(self.steps) < len(self.simulation.steps):
                step = self.simulation.steps[index - len(self.steps)]
            elif self._extend():
                continue
            else:
                return None
            index += 1
            stopped = step.joins.get(priority)
            if stopped is None:
                continue  # past the cycle's depth: not looked at
            decision = stopped.fork().run([job], grow=False)
            if decision.admissions and decision.admissions[-1].job_id == job.job_id:
                placement = decision.admissions[-1].placement
                return Plan(job_id=job.job_id, start=step.at, flavor=decision.admissions[-1].flavor,
                            placement=placement, waits_for=waits_for(step.ended, placement))
            if job.job_id in decision.unplaceable:
                return Plan(job_id=job.job_id, start=None, unplaceable=True)
            if decision.reservation is not None and decision.reservation.job_id == job.job_id:
                return step

    def _horizon(self) -> Horizon:
        if self.horizon is None:
            self.horizon = Horizon(self.simulation)
        return self.horizon

    def _steps(self) -> list[Step]:
        return [*self.steps, *self.simulation.steps]

    def _extend(self) -> bool:
        """One more instant; False once nothing more happens or the cycles allowed have run."""
        simulation = self.simulation
        instant = simulation.next_instant()
        if instant is None or simulation.cycles >= self.max_cycles:
            return False
        simulation.advance(instant)
        simulation.decide()
        return True

    # --- past the playthrough ------------------------------------------------------------------------------

    def _beyond(self, jobs: Sequence[QueuedJob], simulation: Simulation) -> dict[str, Plan]:
        """Plans of `jobs`, queued in `simulation` and not started there: none when nothing more happens in it
        (they wait for jobs without a duration limit, or fit on no node), else the conservative backfill plan
        from where it stopped."""
        if simulation.next_instant() is None:
            return {job.job_id: self._never(job, simulation) for job in jobs}
        return planned_from(simulation, until=jobs[-1].job_id, wanted={job.job_id for job in jobs})

    @staticmethod
    def _never(job: QueuedJob, simulation: Simulation) -> Plan:
        """The plan of a job still queued once nothing more happens: it fits on no node; or it would fit on what
        stays free, and jobs ahead of it that wait for jobs without a duration limit hold it back; or it waits for
        those jobs itself."""
        if job.job_id in simulation.unplaceable:
            return Plan(job_id=job.job_id, start=None, unplaceable=True)
        if choose(Capacity(simulation.cluster, dict(simulation.free)), job.spec, simulation.flavors,
                  job.excluded_nodes) is not None:
            index = next(i for i, queued in enumerate(simulation.queue) if queued.job_id == job.job_id)
            return Plan(job_id=job.job_id, start=None, behind=[
                queued.job_id for queued in simulation.queue[:index] if queued.job_id not in simulation.unplaceable])
        usable = {name for flavor in job.spec.flavors if flavor in simulation.flavors
                  for name in simulation.cluster.eligible(job.spec, simulation.flavors[flavor], job.excluded_nodes)[1]}
        return Plan(job_id=job.job_id, start=None, waits_for=sorted(
            job_id for job_id, held in simulation.running.items() if not usable.isdisjoint(held.held)))


def planned_from(simulation: Simulation, *, until: str, wanted: Collection[str]) -> dict[str, Plan]:
    """The conservative backfill plan (backfill_plan.Planner) of the jobs still queued in `simulation`, from the
    instant it reached, with jobs ending and running as simulated; past its bound, the fluid plan."""
    return Horizon(simulation).queued(until=until, wanted=wanted)


class Horizon:
    """The conservative backfill plan of the jobs a playthrough left queued at its bound, from the state it
    reached, played only as far as the questions asked need and copied at each place a new job can join (as the
    plan stood before backfill_plan's planner planned that place's jobs).

    It plans at most `HORIZON_NODE_JOBS` divided by the number of nodes jobs one by one (the `bound`); the jobs
    behind them are poured into what that plan leaves free (fluid_plan.py), a rough estimate at a few
    microseconds a job, with its own copies at each place."""

    def __init__(self, simulation: Simulation) -> None:
        ending = simulation.ending()
        nodes = [NodeCapacity(info=info, free=simulation.free[info.name]) for info in simulation.infos]
        running = [job if job.ends_at == (end := ending.get(job.job_id)) else job.changed(ends_at=end)
                   for job in simulation.running.values()]
        self.queue = [_as_planned(job, simulation.runtime(job)) for job in simulation.queue]
        # Which jobs fit on no node, the whole queue looked at (the simulation's cycles only look `CYCLE_DEPTH` deep):
        # the plan passes them over rather than searching in vain.
        cycle = Cycle(nodes, simulation.flavors, running, simulation.now, cluster=simulation.cluster)
        unplaceable = [job.job_id for job in self.queue if not cycle.ever_fits(job)]
        decision = Decision(admissions=[], growths=[], reservation=None, unplaceable=unplaceable)
        self.planner = Planner(nodes, simulation.flavors, running, simulation.now, decision, self.queue, None)
        self.bound = max(1, HORIZON_NODE_JOBS // max(1, len(nodes)))
        self.done = 0  # the jobs of `queue` planned by `planner`
        self.copies: dict[int, Planner] = {}
        self.fluid: FluidPlan | None = None  # the jobs from `bound` on, poured
        self.poured = 0  # the jobs of `queue` poured into `fluid`, from `bound` on
        self.fluid_copies: dict[int, FluidPlan] = {}

    def new_job(self, job: QueuedJob) -> Plan:
        """The plan of `job`, joining the queue behind every job of its priority or higher."""
        place = insertion_index(self.queue, job.spec.priority)
        exact = self._at(min(place, self.bound)).fork(until=job.job_id).plan_job(job)
        if place < self.bound or exact.start is None:
            return exact
        return self._rough(job, self._fluid_at(place).fork(), exact)

    def queued(self, *, until: str, wanted: Collection[str]) -> dict[str, Plan]:
        """The plans of `wanted`, queued, each job up to `until` planned; asked of a Horizon asked nothing yet."""
        planner = self.planner
        planner.until = until
        plans = {job_id: plan for job_id, plan in planner.plan(self.queue[:self.bound]).items() if job_id in wanted}
        last = next(i for i, job in enumerate(self.queue) if job.job_id == until)
        if last >= self.bound:
            fluid = FluidPlan(planner)
            for job in self.queue[self.bound:last + 1]:
                plan = self._rough(job, fluid, None)
                if job.job_id in wanted:
                    plans[job.job_id] = plan
        return plans

    def join(self, job: QueuedJob, *, unplaceable: bool) -> None:
        """Take in `job`, just submitted, as if the plan had been made with it queued."""
        place = insertion_index(self.queue, job.spec.priority)
        if place < self.bound:
            self.fluid, self.fluid_copies = None, {}  # a job moves past the bound: poured again
            if (before := self.copies.get(place)) is not None:
                after = before.fork()
                if unplaceable:
                    after.unplaceable.add(job.job_id)
                after.plan_job(job)
                self.copies = {p: c for p, c in self.copies.items() if p <= place} | {place + 1: after}
                if self.done > place:  # it planned past the job: go on from just behind it
                    self.planner, self.done = after.fork(), place + 1
        else:
            self.fluid_copies = {p: c for p, c in self.fluid_copies.items() if p <= place}
            if self.fluid is not None and self.poured > place:  # it poured past the job: go on from before it
                kept = max(self.fluid_copies, default=None)
                self.fluid, self.poured = (None, 0) if kept is None else (self.fluid_copies[kept].fork(), kept)
        if unplaceable:
            self.planner.unplaceable.add(job.job_id)
        self.queue.insert(place, job)

    def _stops(self, place: int, low: int, high: int) -> list[int]:
        """The places in [low, high] where copies are kept on the way to `place`: where jobs of a priority join."""
        stops = {insertion_index(self.queue, priority) for priority in PRIORITIES} | {place}
        return sorted(stop for stop in stops if low <= stop <= min(place, high))

    def _at(self, place: int) -> Planner:
        """The exact plan with the jobs ahead of `place` planned (`place` at most the bound)."""
        for stop in self._stops(place, 0, self.bound):
            if stop not in self.copies:
                self.planner.plan(self.queue[self.done:stop])
                self.copies[stop], self.done = self.planner.fork(), stop
        return self.copies[place]

    def _fluid_at(self, place: int) -> FluidPlan:
        """The fluid plan with the jobs from the bound up to `place` poured (`place` at least the bound)."""
        if self.fluid is None:
            self.fluid, self.poured, self.fluid_copies = FluidPlan(self._at(self.bound)), self.bound, {}
        for stop in self._stops(place, self.bound, len(self.queue)):
            if stop not in self.fluid_copies:
                for job in self.queue[self.poured:stop]:
                    self._pour(job, self.fluid)
                self.fluid_copies[stop], self.poured = self.fluid.fork(), stop
        return self.fluid_copies[place]

    def _pour(self, job: QueuedJob, fluid: FluidPlan) -> tuple[int | None, str | None] | None:
        """`job` poured into `fluid` (`FluidPlan.pour`); None, and nothing poured, when it fits on no node: it never
        holds anyone back."""
        return None if job.job_id in self.planner.unplaceable else fluid.pour(job)

    def _rough(self, job: QueuedJob, fluid: FluidPlan, exact: Plan | None) -> Plan:
        """The plan of `job` poured into `fluid`, never earlier than `exact`, its plan behind the bound's jobs alone
        (where it would go, for a new job)."""
        if (poured := self._pour(job, fluid)) is None:
            return Plan(job_id=job.job_id, start=None, unplaceable=True)
        moment, flavor = poured
        if moment is None:
            return Plan(job_id=job.job_id, start=None, rough=True)
        start = self.planner.now + timedelta(microseconds=moment)
        if exact is None:
            return Plan(job_id=job.job_id, start=start, flavor=flavor, rough=True)
        assert exact.start is not None
        return replace(exact, start=max(start, exact.start), waits_for=[] if start > exact.start else exact.waits_for,
                       rough=start > exact.start)


def _as_planned(job: QueuedJob, runtime: int | None) -> QueuedJob:
    """A queued job as the conservative plan takes it: for as long as it runs."""
    if runtime is None:
        return job
    if job.duration_seconds is not None:
        runtime = min(runtime, job.duration_seconds)  # stopped at its limit
    return job if runtime == job.duration_seconds else job.lasting(runtime)


def _plan_of(start: Started) -> Plan:
    return Plan(job_id=start.job_id, start=start.at, flavor=start.flavor, placement=start.placement,
                waits_for=start.waits_for)
