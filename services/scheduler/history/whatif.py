"""What if: recorded history replayed through the scheduler's own cycles in virtual time (`trainyard simulate`).

The state at the start of the window (the nodes, the running jobs and the queue, rebuilt from the log by past.py)
is played forward with `Simulation`: every job submitted in the window joins the queue at the instant it really
was, with the spec it was submitted with, and runs as long as it really ran; the jobs running at the start end
when they really ended. The cluster may be changed first (nodes added or removed per flavor, the cycle's depth).
Beside what really happened, the report gives the waits per priority, the makespan, the use per flavor, the jobs
whose start moved most, and the queue and the use over time.

With no change the simulated starts follow the real ones, but not to the microsecond: the live scheduler starts a
job at its next cycle after the change that lets it (a cycle runs at most every 0.1 s, and what it decides is
recorded a moment later), the simulation at the instant of the change. What the replay cannot know is listed in
the report's notes. Pure: no clock, no I/O; `progress` is told how far virtual time has gone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import PRIORITY_RANK
from libs.contracts.operations.base import TERMINAL_STATUSES
from libs.contracts.operations.planning import (
    FlavorUse,
    MovedJob,
    PriorityWaits,
    SimulateHistory,
    SimulationPoint,
    SimulationReport,
)
from libs.placement import CYCLE_DEPTH, NodeCapacity, QueuedJob, RunningJob, holdings
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.domain.views import applies_to
from services.scheduler.planning.decision_inputs import cluster_flavors, node_capacity, queued_jobs, running_jobs
from services.scheduler.planning.simulation import Arrival, Simulation

MAX_CYCLES = 2_000_000  # a replay that would run longer stops there, and says so
SERIES_POINTS = 240
MOVED_SHOWN = 20
SAME_START = timedelta(seconds=1)
NOTES = (
    "The nodes are those known at the start or the end of the window, present throughout.",
    "Priority changes after submission, faults, resumes, restarts, pre-checks, the growth of elastic jobs and the "
    "%N caps of arrays are not replayed; a job runs once, as long as its attempts ran in all.",
)


class WhatIfError(ValueError):
    """A change that cannot be made to this cluster (the message says which and why)."""


@dataclass(frozen=True)
class Recorded:
    """What really happened to one job, as the state at the end of the window tells it."""

    job: QueuedJob  # as submitted: its spec (and priority) then, its limit
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    status: str
    flavor: Flavor | None  # the flavor it ran with
    placement: tuple[Placement, ...]


@dataclass(frozen=True)
class Start:
    """The state at the start of the window, as a cycle saw it then."""

    at: datetime
    nodes: Sequence[NodeCapacity]  # schedulable then, with what was free
    running: Sequence[RunningJob]
    queue: Sequence[QueuedJob]
    flavors: Mapping[str, Flavor]

    @classmethod
    def of(cls, state: SchedulerState, at: datetime) -> Start:
        """The scheduler's state at `at`, as its cycle reads it (copied: the state goes on)."""
        return cls(at=at, nodes=node_capacity(state), flavors=dict(cluster_flavors(state)),
                   running=running_jobs(state, at), queue=queued_jobs(state, at))


@dataclass(frozen=True)
class _Comparison:
    compared: int  # jobs started both really and in the simulation
    same_start: int  # of those, within a second
    p50: float | None  # of the absolute differences of their starts, seconds
    p95: float | None
    moved: list[MovedJob]


@dataclass(frozen=True)
class _Life:
    start: datetime | None
    end: datetime | None
    flavor: Flavor | None
    placement: Sequence[Placement]


def what_if(request: SimulateHistory, start: Start, end: datetime, history: Mapping[str, Recorded],
            nodes_at_end: Iterable[NodeInfo], *, progress: Callable[[float], None] = lambda _: None,
            ) -> SimulationReport:
    """Replay the window [start.at, end] with the request's changes (see the module's description)."""
    nodes, real_nodes = _cluster(start, nodes_at_end)
    nodes = _changed(nodes, start, request)
    left_out = {job_id for job_id, r in history.items() if r.started_at is None and r.status in TERMINAL_STATUSES}
    arrivals = [Arrival(r.submitted_at, r.job, _runtime(r)) for job_id, r in history.items()
                if start.at < r.submitted_at <= end and job_id not in left_out]
    queue = [job for job in start.queue if job.job_id not in left_out]
    ends = {job.job_id: history[job.job_id].ended_at if job.job_id in history else job.ends_at
            for job in start.running}
    runtimes = {job.job_id: _runtime(history[job.job_id]) for job in queue if job.job_id in history}
    simulation = Simulation(nodes, start.flavors, running=start.running, queue=queue, now=start.at, ends=ends,
                            runtimes=runtimes, arrivals=arrivals, depth=request.depth or CYCLE_DEPTH)
    span = max((end - start.at).total_seconds(), 1.0)
    simulation.decide()
    while (instant := simulation.next_instant()) is not None and simulation.cycles < MAX_CYCLES:
        simulation.advance(instant)
        simulation.decide()
        progress(min(1.0, (instant - start.at).total_seconds() / span))
    progress(1.0)

    replayed = [job.job_id for job in start.running] + [job.job_id for job in queue] + [a.job.job_id
                                                                                         for a in arrivals]
    real = {job_id: _real_life(job_id, history, start) for job_id in replayed}
    simulated = {job_id: _simulated_life(job_id, simulation, start) for job_id in replayed}
    submitted = {job_id: history[job_id].submitted_at if job_id in history else start.at for job_id in replayed}
    running = {job.job_id for job in start.running}
    comparison = _compared([job_id for job_id in replayed if job_id not in running], history, submitted, real,
                           simulated)
    notes = list(NOTES)
    if left_out:
        notes.append(f"{len(left_out)} jobs stopped or deleted before they started are left out.")
    if simulation.cycles >= MAX_CYCLES:
        notes.append(f"The replay stopped after {MAX_CYCLES:,} cycles, at {simulation.now.isoformat()}.")
    return SimulationReport(
        start=start.at, end=end, jobs=len(replayed), nodes_real=len(real_nodes), nodes_simulated=len(nodes),
        cycles=simulation.cycles, waits=_waits(replayed, history, start, submitted, real, simulated, end),
        makespan_real_seconds=_makespan(real.values(), start.at),
        makespan_simulated_seconds=_makespan([simulated[j] for j, life in real.items() if life.end], start.at),
        utilization=_utilization(start.flavors, real, simulated, real_nodes, nodes, start.at, end),
        compared=comparison.compared, same_start=comparison.same_start,
        start_difference_p50=comparison.p50, start_difference_p95=comparison.p95, moved=comparison.moved,
        series=_series(submitted, real, simulated, real_nodes, nodes, start.at, end), notes=notes)


def recorded(jobs: Mapping[str, Job], flavors: Mapping[str, Flavor], start: Start,
             end: datetime) -> dict[str, Recorded]:
    """What happened to the jobs of the window (queued or running at its start, or submitted in it), from the
    state at its end."""
    at_start = {job.job_id: job for job in start.queue}
    wanted = set(at_start) | {job.job_id for job in start.running}
    history: dict[str, Recorded] = {}
    for job_id, job in jobs.items():
        if job_id not in wanted and not start.at < job.submitted_at <= end:
            continue
        queued = at_start.get(job_id) or QueuedJob(job_id, job.spec, job.duration_seconds)
        history[job_id] = Recorded(job=queued, submitted_at=job.submitted_at, started_at=job.started_at,
                                   ended_at=job.ended_at, status=job.status,
                                   flavor=flavors.get(job.flavor) if job.flavor else None,
                                   placement=tuple(job.placement))
    return history


# --- the cluster ------------------------------------------------------------------------------------------------


def _cluster(start: Start, nodes_at_end: Iterable[NodeInfo]) -> tuple[list[NodeCapacity], list[NodeInfo]]:
    """The nodes of the window (schedulable at its start, or known at its end), each with what was free at the start:
    all of it, less what the jobs running then held."""
    infos = {n.info.name: n.info for n in start.nodes}
    for info in nodes_at_end:
        infos.setdefault(info.name, info)
    held: dict[str, Resources] = {}
    for job in start.running:
        for name, amount in job.held.items():
            held[name] = held.get(name, Resources()) + amount
    ordered = [infos[name] for name in sorted(infos)]
    return ([NodeCapacity(info=info, free=Resources.of_node(info) - held.get(info.name, Resources()))
             for info in ordered], ordered)


def _changed(nodes: list[NodeCapacity], start: Start, request: SimulateHistory) -> list[NodeCapacity]:
    busy = {name for job in start.running for name in job.held}
    for flavor_name, count in request.remove_nodes.items():
        flavor = _flavor(start, flavor_name)
        idle = [n for n in nodes if applies_to(flavor, n.info) and n.info.name not in busy]
        if len(idle) < count:
            raise WhatIfError(f"--remove-nodes {flavor_name}={count}: only {len(idle)} nodes of {flavor_name} were "
                              f"idle at the start of the window")
        gone = {n.info.name for n in idle[-count:]}
        nodes = [n for n in nodes if n.info.name not in gone]
    for flavor_name, count in request.add_nodes.items():
        flavor = _flavor(start, flavor_name)
        fitting = [n.info for n in nodes if applies_to(flavor, n.info)]
        if not fitting:
            raise WhatIfError(f"--add-nodes {flavor_name}={count}: no node of the cluster takes {flavor_name}, so "
                              f"there is none to copy")
        model = max(fitting, key=lambda info: (Resources.of_node(info).accelerators, info.cpus, info.memory_mib,
                                               info.name))
        taken = {n.info.name for n in nodes}
        added = [f"{model.name}-sim-{i}" for i in range(1, len(taken) + count + 1)
                 if f"{model.name}-sim-{i}" not in taken][:count]
        nodes = nodes + [NodeCapacity(info=_copy(model, name), free=Resources.of_node(model)) for name in added]
    return nodes


def _copy(model: NodeInfo, name: str) -> NodeInfo:
    return msgspec.structs.replace(model, name=name)


def _flavor(start: Start, name: str) -> Flavor:
    flavor = start.flavors.get(name)
    if flavor is None:
        raise WhatIfError(f"unknown flavor {name!r}: choose from {', '.join(sorted(start.flavors))}")
    return flavor


def _runtime(record: Recorded) -> int | None:
    """How long it runs once started: as long as it really ran; until its limit when it never started in the window
    (None: for good); and a job still running at the end runs on until its limit."""
    if record.started_at is not None and record.ended_at is not None:
        return max(0, round((record.ended_at - record.started_at).total_seconds()))
    return record.job.duration_seconds


# --- what happened, and what would have ---------------------------------------------------------------------------


def _real_life(job_id: str, history: Mapping[str, Recorded], start: Start) -> _Life:
    record = history.get(job_id)
    if record is None:  # ran since before the window and still holds what it held then
        running = next(job for job in start.running if job.job_id == job_id)
        return _Life(None, None, running.flavor, running.placement)
    return _Life(record.started_at, record.ended_at, record.flavor, record.placement)


def _simulated_life(job_id: str, simulation: Simulation, start: Start) -> _Life:
    started = simulation.started.get(job_id)
    if started is not None:
        return _Life(started.at, started.ends_at, start.flavors.get(started.flavor), started.placement)
    running = next((job for job in start.running if job.job_id == job_id), None)
    if running is not None:  # running at the start of the window
        return _Life(None, simulation.ended.get(job_id), running.flavor, running.placement)
    return _Life(None, None, None, ())


def _percentile(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _waits(replayed: Sequence[str], history: Mapping[str, Recorded], start: Start, submitted: Mapping[str, datetime],
           real: Mapping[str, _Life], simulated: Mapping[str, _Life], end: datetime) -> list[PriorityWaits]:
    """Submit to start, per priority, of the jobs that waited in the window and started by its end."""
    running = {job.job_id for job in start.running}
    waiting = [job_id for job_id in replayed if job_id in history and job_id not in running]
    by_priority: dict[str, list[str]] = {}
    for job_id in waiting:
        by_priority.setdefault(history[job_id].job.spec.priority, []).append(job_id)
    rows = []
    for priority in sorted(by_priority, key=lambda p: -PRIORITY_RANK[p]):
        jobs = by_priority[priority]

        def waited(lives: Mapping[str, _Life], jobs: list[str] = jobs) -> list[float]:
            return [(start_at - submitted[j]).total_seconds() for j in jobs
                    if (start_at := lives[j].start) is not None and start_at <= end]

        real_waits, simulated_waits = waited(real), waited(simulated)
        rows.append(PriorityWaits(priority=priority, jobs=len(jobs), real_p50=_percentile(real_waits, 0.5),
                                  real_p95=_percentile(real_waits, 0.95),
                                  simulated_p50=_percentile(simulated_waits, 0.5),
                                  simulated_p95=_percentile(simulated_waits, 0.95)))
    return rows


def _makespan(lives: Iterable[_Life], start: datetime) -> float | None:
    """From the window's start to the last end (simulated: of the jobs that really ended, as those that had not end
    at their limits in the simulation)."""
    ends = [life.end for life in lives if life.end is not None]
    return (max(ends) - start).total_seconds() if ends else None


def _key_resource(flavor: Flavor) -> str:
    return "accelerators" if flavor.accelerators else "cpus"


def _held(life: _Life, what: str) -> float:
    if life.flavor is None or not life.placement:
        return 0.0
    return float(sum(getattr(amount, what) for amount in holdings(list(life.placement), life.flavor).values()))


def _overlap(life: _Life, begin: datetime, end: datetime) -> float:
    """Seconds of [begin, end] it held its nodes (a job running since before the window: from `begin`)."""
    held_from = max(life.start or begin, begin)
    held_until = min(life.end or end, end)
    return max(0.0, (held_until - held_from).total_seconds())


def _utilization(flavors: Mapping[str, Flavor], real: Mapping[str, _Life], simulated: Mapping[str, _Life],
                 real_nodes: Sequence[NodeInfo], nodes: Sequence[NodeCapacity], begin: datetime,
                 end: datetime) -> list[FlavorUse]:
    seconds = max((end - begin).total_seconds(), 1.0)

    def use(lives: Mapping[str, _Life], infos: Sequence[NodeInfo], flavor: Flavor) -> float:
        what = _key_resource(flavor)
        total = sum(getattr(Resources.of_node(info), what) for info in infos) * seconds
        held = sum(_held(life, what) * _overlap(life, begin, end) for life in lives.values()
                   if life.flavor is not None and life.flavor.name == flavor.name)
        return round(held / total, 4) if total else 0.0

    used = {life.flavor.name for lives in (real, simulated) for life in lives.values() if life.flavor is not None}
    return [FlavorUse(flavor=name, real=use(real, real_nodes, flavors[name]),
                      simulated=use(simulated, [n.info for n in nodes], flavors[name]))
            for name in sorted(used) if name in flavors]


def _compared(waited: Sequence[str], history: Mapping[str, Recorded], submitted: Mapping[str, datetime],
              real: Mapping[str, _Life], simulated: Mapping[str, _Life]) -> _Comparison:
    """The starts of the jobs that waited in the window (not those running at its start), real against simulated."""
    both = [job_id for job_id in waited if real[job_id].start is not None and simulated[job_id].start is not None]
    differences = {job_id: abs((simulated[job_id].start - real[job_id].start).total_seconds())  # type: ignore[operator]
                   for job_id in both}
    far = float("inf")
    moved = sorted((job_id for job_id in waited if job_id in history
                    and (real[job_id].start is not None or simulated[job_id].start is not None)
                    and differences.get(job_id, far) >= SAME_START.total_seconds()),
                   key=lambda job_id: -differences.get(job_id, far))[:MOVED_SHOWN]
    values = list(differences.values())
    return _Comparison(
        compared=len(both), same_start=sum(value < SAME_START.total_seconds() for value in values),
        p50=statistics.median(values) if values else None, p95=_percentile(values, 0.95),
        moved=[MovedJob(job_id=job_id, name=history[job_id].job.spec.name, priority=history[job_id].job.spec.priority,
                        submitted_at=submitted[job_id], real_start=real[job_id].start,
                        simulated_start=simulated[job_id].start) for job_id in moved])


def _series(submitted: Mapping[str, datetime], real: Mapping[str, _Life], simulated: Mapping[str, _Life],
            real_nodes: Sequence[NodeInfo], nodes: Sequence[NodeCapacity], begin: datetime,
            end: datetime) -> list[SimulationPoint]:
    """The queue's length and the share of CPUs held at evenly spaced instants of the window."""
    step = (end - begin) / (SERIES_POINTS - 1)
    real_cpus = sum(info.cpus for info in real_nodes) or 1.0
    simulated_cpus = sum(n.info.cpus for n in nodes) or 1.0
    cpus = {job_id: (_held(real[job_id], "cpus"), _held(simulated[job_id], "cpus")) for job_id in submitted}

    def at(t: datetime, lives: Mapping[str, _Life], which: int) -> tuple[int, float]:
        queued, busy = 0, 0.0
        for job_id, life in lives.items():
            began = life.start if life.start is not None else (begin if life.placement and life.flavor else None)
            if submitted[job_id] <= t and (began is None or began > t):
                queued += 1
            elif began is not None and began <= t and (life.end is None or life.end > t):
                busy += cpus[job_id][which]
        return queued, busy

    points = []
    for index in range(SERIES_POINTS):
        t = begin + step * index
        queued_real, busy_real = at(t, real, 0)
        queued_simulated, busy_simulated = at(t, simulated, 1)
        points.append(SimulationPoint(at=t, queued_real=queued_real, queued_simulated=queued_simulated,
                                      busy_real=round(busy_real / real_cpus, 4),
                                      busy_simulated=round(busy_simulated / simulated_cpus, 4)))
    return points
