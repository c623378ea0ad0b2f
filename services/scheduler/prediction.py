"""Queue prediction (SPEC S6): would a job start now, and if not, when it would likely start.

The estimate plays the queue forward: this cycle's decision first, then the jobs still queued, one
after another in start order, each at the earliest time it fits and not before the jobs ahead of it
on the same kind of nodes. It is played twice:

- the *latest* start: running jobs, and jobs planned to start, free their nodes at the end of their
  duration limit; a job without a limit holds its nodes for good, so a job waiting for such nodes has
  no estimate, and the jobs behind it are planned around the nodes it waits for;
- the *likely* start (`Expected`): the same, but each job frees its nodes when jobs like it usually
  end (runtime_model.py), which is what `estimated_start` says when it is known.

Backfilled jobs and later higher-priority submissions can move either estimate. `PredictionCache`
(prediction_cache.py) answers the same as `predict` without planning the queue for every question.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Flavor, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec, Priority
from libs.contracts.scheduling import Prediction
from services.scheduler.placement import (
    Admission,
    Capacity,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    Shape,
    choose,
    holdings,
    job_shape,
    parameter_server_count,
    schedule,
)

NEW_JOB = "(new job)"  # the id a predicted job gets; real job ids look like job-<12 hex digits>
_NodeClass = tuple[tuple[str, ...], str | None, str | None]  # pools, board, driver version


@dataclass(frozen=True)
class Plan:
    """When one queued job is expected to start, and what that depends on."""

    job_id: str
    start: datetime | None
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    # Known start: the jobs whose end lets it start. Unknown start: the jobs without a duration limit
    # it waits for.
    waits_for: list[str] = field(default_factory=list)
    behind: list[str] = field(default_factory=list)  # unknown start: jobs ahead of unknown start in its way
    unplaceable: bool = False  # fits on no node of the cluster


@dataclass(frozen=True)
class Expected:
    """When jobs will likely end, where that is known better than their duration limits.

    Jobs not listed end at their limits; a listed None means no end is known (held for good).
    """

    ends: Mapping[str, datetime | None] = field(default_factory=dict)  # running job -> likely end
    seconds: Mapping[str, int | None] = field(default_factory=dict)  # queued job -> likely runtime

    @property
    def empty(self) -> bool:
        return not self.ends and not self.seconds

    def running(self, jobs: Sequence[RunningJob]) -> list[RunningJob]:
        return [replace(job, ends_at=self.ends[job.job_id]) if job.job_id in self.ends else job for job in jobs]

    def queue(self, jobs: Sequence[QueuedJob]) -> list[QueuedJob]:
        return [replace(job, duration_seconds=self.seconds[job.job_id]) if job.job_id in self.seconds else job
                for job in jobs]


@dataclass(frozen=True)
class Forecast:
    """A prediction, and the start it would have if every job ran to its duration limit."""

    prediction: Prediction
    latest_start: datetime | None = None


def format_time(moment: datetime, now: datetime) -> str:
    """`14:05 UTC`, with the date when it is not today's."""
    if moment.tzinfo is not None:
        moment, now = moment.astimezone(UTC), now.astimezone(UTC) if now.tzinfo else now
    text = moment.strftime("%H:%M UTC")
    return text if moment.date() == now.date() else f"{moment:%Y-%m-%d} {text}"


def names(ids: Sequence[str], limit: int = 3) -> str:
    """`job-a`, `job-a and job-b`, `job-a, job-b, job-c and 2 more`."""
    shown = list(ids[:limit])
    if len(ids) > limit:
        return f"{', '.join(shown)} and {len(ids) - limit} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def insertion_index(queue: Sequence[QueuedJob], priority: Priority) -> int:
    """Where a new job of `priority` joins the queue: behind every job of the same or a higher priority."""
    rank = PRIORITY_RANK[priority]
    return next((i for i, job in enumerate(queue) if PRIORITY_RANK[job.spec.priority] > rank), len(queue))


def plan_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
               running: Sequence[RunningJob] = (), now: datetime, decision: Decision | None = None,
               until: str | None = None) -> dict[str, Plan]:
    """Plan every queued job (or those up to and including `until`), in start order. Only the plan of
    `until` says which jobs without a duration limit an unknown start depends on.

    `decision` is this cycle's `schedule` result for the same inputs, when the caller has it already.
    """
    if decision is None:
        decision = schedule(queue, nodes, flavors, running=running, now=now)
    return Planner(nodes, flavors, running, now, decision, queue, until).plan(queue)


class Planner:
    """Plays the queue forward in time.

    Nodes fall into classes (same pools, board and driver); each class has its own planning clock,
    so a CPU job is not planned after a GPU job ahead of it just because that one waits long. Within
    the classes a job may use, jobs are planned one after another in start order, each at the
    earliest time, not before those classes' clocks, when it fits; as planned starts never go back
    on a node, a job that fits when it starts keeps fitting.

    Besides what is free at the clocks, two views are kept: what will be free once every job with a
    duration limit has ended ("final"), and what would be free if every job ended ("everything"). A
    job that does not fit in "final" waits on jobs without a limit: its start is unknown and, as the
    scheduler does for a head in that state, the nodes it would take in "everything" are set aside
    for it, so the jobs behind it are planned around them.
    """

    def __init__(self, nodes: list[NodeCapacity], flavors: dict[str, Flavor], running: Sequence[RunningJob],
                 now: datetime, decision: Decision, queue: list[QueuedJob], until: str | None) -> None:
        self.flavors = flavors
        self.until = until
        self.now = now
        self.capacity = Capacity.of(nodes)
        self.final = self.capacity.copy()
        self.everything = self.capacity.copy()
        self.node_class = {n.info.name: (tuple(n.info.pools), n.info.board, n.info.driver_version) for n in nodes}
        self.clocks: dict[_NodeClass, datetime] = dict.fromkeys(self.node_class.values(), now)
        # Per class, a heap of (end, tie-breaker, job, what it gives back on that class's nodes).
        self.releases: dict[_NodeClass, list[tuple[datetime, int, str, dict[str, Resources]]]] = {
            k: [] for k in self.clocks}
        self.released_last: dict[_NodeClass, list[str]] = {k: [] for k in self.clocks}  # ended at the clock
        self.pushed = 0  # keeps the heaps from ever comparing holdings
        self.unlimited: list[tuple[str, dict[str, Resources]]] = []  # holders without a duration limit
        self.set_aside: list[tuple[str, dict[str, Resources]]] = []  # jobs of unknown start, and their nodes
        # Per job shape: the nodes it may use and their classes; and a placement found in "final", which
        # holds as long as none of its nodes lost room there ("final" only ever shrinks).
        self.usable: dict[Shape, tuple[set[str], set[_NodeClass]]] = {}
        self.fits_finally: dict[Shape, dict[str, int]] = {}
        self.final_shrinks: dict[str, int] = {}  # per node, how often "final" lost room on it
        self.no_room: set[Shape] = set()  # shapes that no longer fit in "everything"
        self.plans: dict[str, Plan] = {}
        self.unplaceable = set(decision.unplaceable)
        for holder in running:  # the views were built without what running jobs hold
            held = holdings(holder.placement, holder.flavor)
            self.everything.give(held)
            if holder.ends_at is None:
                self.unlimited.append((holder.job_id, held))
            else:
                self.final.give(held)
                self._release(holder.job_id, held, holder.ends_at)
        durations = {job.job_id: job.duration_seconds for job in queue}
        for admission in decision.admissions:
            self._start(admission.job_id, holdings(admission.placement, flavors[admission.flavor]), now,
                        durations.get(admission.job_id))
            self.plans[admission.job_id] = Plan(job_id=admission.job_id, start=now, flavor=admission.flavor,
                                                placement=admission.placement)
        self.started = dict(self.plans)  # this cycle's admissions: planned already

    def fork(self, until: str | None = None) -> Planner:
        """An independent copy to plan on, as far as this one has planned; of the plans made so far it
        keeps only those of this cycle's admissions."""
        twin = copy.copy(self)
        twin.until = until
        twin.capacity, twin.final, twin.everything = self.capacity.copy(), self.final.copy(), self.everything.copy()
        twin.clocks = dict(self.clocks)
        twin.releases = {k: list(heap) for k, heap in self.releases.items()}
        twin.released_last = {k: list(ended) for k, ended in self.released_last.items()}
        twin.unlimited, twin.set_aside = list(self.unlimited), list(self.set_aside)
        twin.fits_finally, twin.final_shrinks = dict(self.fits_finally), dict(self.final_shrinks)
        twin.no_room, twin.unplaceable = set(self.no_room), set(self.unplaceable)
        twin.plans = dict(self.started)
        return twin  # `usable` only depends on the nodes: shared

    def _start(self, job_id: str, held: dict[str, Resources], start: datetime, seconds: int | None) -> None:
        self.capacity.take(held)
        if seconds is None:
            self.unlimited.append((job_id, held))
            self._shrink_final(held)
        else:
            self._release(job_id, held, start + timedelta(seconds=seconds))

    def _shrink_final(self, held: dict[str, Resources]) -> None:
        self.final.take(held)
        for name in held:
            self.final_shrinks[name] = self.final_shrinks.get(name, 0) + 1

    def _release(self, job_id: str, held: dict[str, Resources], ends: datetime) -> None:
        by_class: dict[_NodeClass, dict[str, Resources]] = {}
        for name, amount in held.items():
            if name in self.node_class:
                by_class.setdefault(self.node_class[name], {})[name] = amount
        for node_class, part in by_class.items():
            self.pushed += 1
            heapq.heappush(self.releases[node_class], (max(ends, self.now), self.pushed, job_id, part))

    def plan(self, queue: Sequence[QueuedJob]) -> dict[str, Plan]:
        for job in queue:
            if job.job_id not in self.plans:
                self.plans[job.job_id] = self._plan(job)
            if job.job_id == self.until:
                break
        return self.plans

    def plan_job(self, job: QueuedJob) -> Plan:
        """Plan one more job behind those planned so far."""
        return self.plan([job])[job.job_id]

    def _plan(self, job: QueuedJob) -> Plan:
        if job.job_id in self.unplaceable:
            return Plan(job_id=job.job_id, start=None, unplaceable=True)
        shape = job_shape(job.spec, job.excluded_nodes)
        if not self._fits_finally(job, shape):
            return self._set_aside(job, shape)
        _, classes = self._usable(job, shape)
        clock = max(self.clocks[k] for k in classes)
        self._advance(classes, clock)
        while (choice := choose(self.capacity, job.spec, self.flavors, job.excluded_nodes)) is None:
            upcoming = [self.releases[k][0][0] for k in classes if self.releases[k]]
            if not upcoming:  # fits in "final", but in no order this placement tries on the way there
                return self._set_aside(job, shape)
            clock = min(upcoming)
            self._advance(classes, clock)
        flavor_name, placement = choice
        self._start(job.job_id, holdings(placement, self.flavors[flavor_name]), clock, job.duration_seconds)
        ended = [] if clock == self.now else sorted({j for k in classes for j in self.released_last[k]})
        return Plan(job_id=job.job_id, start=clock, flavor=flavor_name, placement=placement, waits_for=ended)

    def _fits_finally(self, job: QueuedJob, shape: Shape) -> bool:
        known = self.fits_finally.get(shape)
        if known is not None and all(self.final_shrinks.get(n, 0) == count for n, count in known.items()):
            return True
        choice = choose(self.final, job.spec, self.flavors, job.excluded_nodes)
        if choice is None:
            return False
        self.fits_finally[shape] = {p.node: self.final_shrinks.get(p.node, 0) for p in choice[1]}
        return True

    def _usable(self, job: QueuedJob, shape: Shape) -> tuple[set[str], set[_NodeClass]]:
        """The nodes any rank of the job may use, and their classes."""
        if shape not in self.usable:
            spec = job.spec
            kinds = [self.flavors[name] for name in spec.flavors if name in self.flavors]
            if parameter_server_count(spec):
                kinds.append(PARAMETER_SERVER_FLAVOR)
            nodes: set[str] = set()
            for flavor in kinds:
                nodes.update(self.capacity.cluster.eligible(spec, flavor, job.excluded_nodes)[1])
            self.usable[shape] = nodes, {self.node_class[name] for name in nodes}
        return self.usable[shape]

    def _advance(self, classes: set[_NodeClass], clock: datetime) -> None:
        """Bring `classes` to `clock`, giving back what ends by then."""
        for node_class in classes:
            if self.clocks[node_class] < clock:
                self.clocks[node_class] = clock
                self.released_last[node_class] = []
            heap = self.releases[node_class]
            while heap and heap[0][0] <= clock:
                _, _, ended, held = heapq.heappop(heap)
                self.capacity.give(held)
                self.released_last[node_class].append(ended)

    def _set_aside(self, job: QueuedJob, shape: Shape) -> Plan:
        waits_for: list[str] = []
        behind: list[str] = []
        if job.job_id == self.until:  # who it waits for is only told for the job asked about
            usable, _ = self._usable(job, shape)
            waits_for = sorted({job_id for job_id, held in self.unlimited if usable.intersection(held)})
            behind = [job_id for job_id, held in self.set_aside if usable.intersection(held)]
        choice = None if shape in self.no_room else choose(self.everything, job.spec, self.flavors,
                                                           job.excluded_nodes)
        if choice is None:
            self.no_room.add(shape)  # "everything" only shrinks
        else:
            held = holdings(choice[1], self.flavors[choice[0]])
            self.capacity.take(held)
            self.everything.take(held)
            self._shrink_final(held)
            self.set_aside.append((job.job_id, held))
        return Plan(job_id=job.job_id, start=None, waits_for=waits_for, behind=behind)


def unknown_start_reason(plan: Plan) -> str:
    """Why a plan has no start, as the end of a sentence."""
    if plan.behind:
        verb = "waits" if len(plan.behind) == 1 else "wait"
        return f"{names(plan.behind)} ahead of it {verb} for jobs without a duration limit"
    if plan.waits_for:
        verb = "has" if len(plan.waits_for) == 1 else "have"
        return f"it waits for {names(plan.waits_for)}, which {verb} no duration limit"
    return "it waits for jobs without a duration limit"


def predict_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
                  running: Sequence[RunningJob] = (), now: datetime) -> dict[str, datetime | None]:
    """The expected start of every queued job (None: unknown, or it fits on no node)."""
    return {job_id: plan.start for job_id, plan in
            plan_queue(queue, nodes, flavors, running=running, now=now).items()}


def predict(spec: JobSpec, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
            running: Sequence[RunningJob] = (), now: datetime, duration_seconds: int | None = None,
            expected: Expected | None = None) -> Prediction:
    """S6: what would happen if `spec` were submitted now (see `forecast`)."""
    return forecast(spec, queue, nodes, flavors, running=running, now=now, duration_seconds=duration_seconds,
                    expected=expected).prediction


def forecast(spec: JobSpec, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
             running: Sequence[RunningJob] = (), now: datetime, duration_seconds: int | None = None,
             expected: Expected | None = None) -> Forecast:
    """S6: what would happen if `spec` were submitted now; its likely start from `expected`, its latest
    from the duration limits.

    The job joins the queue behind every job of the same or a higher priority. Jobs ahead of it that
    this cycle starts, or that fit on no node and so never block anyone, are not counted as ahead.
    """
    if duration_seconds is None:
        duration_seconds = spec.max_duration_seconds
    index = insertion_index(queue, spec.priority)
    ordered = [*queue[:index], QueuedJob(NEW_JOB, spec, duration_seconds), *queue[index:]]
    decision = schedule(ordered, nodes, flavors, running=running, now=now)
    admitted = {admission.job_id: admission for admission in decision.admissions}
    if (mine := admitted.get(NEW_JOB)) is not None:
        return starts_now(mine, now)
    skipped = set(admitted).union(decision.unplaceable)  # started now, or never blocking it
    jobs_ahead = sum(1 for job in queue[:index] if job.job_id not in skipped)
    latest = plan_queue(ordered, nodes, flavors, running=running, now=now, decision=decision, until=NEW_JOB)[NEW_JOB]
    likely = latest
    if expected is not None and not expected.empty:
        likely = plan_queue(expected.queue(ordered), nodes, flavors, running=expected.running(running), now=now,
                            decision=decision, until=NEW_JOB)[NEW_JOB]
    return waits(spec, now, jobs_ahead, latest, likely)


def starts_now(admission: Admission, now: datetime) -> Forecast:
    hosts = [p.node for p in admission.placement]
    workers = sum(1 for p in admission.placement if p.role == "worker")
    return Forecast(Prediction(
        starts_now=True, flavor=admission.flavor, nodes=hosts, node_count=workers, predicted_at=now,
        reason=f"Starts now with flavor {admission.flavor} on {', '.join(dict.fromkeys(hosts))}."), now)


def waits(spec: JobSpec, now: datetime, jobs_ahead: int, latest: Plan, likely: Plan) -> Forecast:
    """The forecast of a job that queues behind `jobs_ahead` jobs, from its two plans."""
    plan = likely if likely.start is not None else latest
    workers = sum(1 for p in plan.placement if p.role == "worker")

    def answer(reason: str, start: datetime | None = None) -> Forecast:
        return Forecast(Prediction(starts_now=False, flavor=plan.flavor, node_count=workers, position=jobs_ahead + 1,
                                   jobs_ahead=jobs_ahead, estimated_start=start, predicted_at=now, reason=reason,
                                   latest_start=latest.start),
                        latest.start)

    if latest.unplaceable:
        return answer(f"Fits on no node of this cluster with flavor {', '.join(spec.flavors)}, "
                      "even with every node free.")
    behind = f"Waits behind {jobs_ahead} job{'s' if jobs_ahead != 1 else ''}" if jobs_ahead else "First in line"
    if plan.start is None:
        return answer(f"{behind}; its start cannot be estimated because {unknown_start_reason(likely)}.")
    if plan is latest or likely.start == latest.start:
        return answer(f"{behind}; expected to start at {format_time(plan.start, now)}{_when_ends(plan)}.", plan.start)
    when = f"expected to start around {format_time(plan.start, now)}, going by how long similar jobs ran"
    if latest.start is None:
        when += f"; no later start can be promised as {unknown_start_reason(latest)}"
    else:
        when += (f"; by {format_time(latest.start, now)}{_when_ends(latest)} if jobs run to their "
                 "duration limits")
    return answer(f"{behind}; {when}.", plan.start)


def _when_ends(plan: Plan) -> str:
    if not plan.waits_for:
        return ""
    return f" when {names(plan.waits_for)} {'ends' if len(plan.waits_for) == 1 else 'end'}"
