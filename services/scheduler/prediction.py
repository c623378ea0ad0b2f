"""Queue prediction (SPEC S6): would a job start now, and if not, when it would likely start.

The estimate plays the queue forward: this cycle's decision first, then the jobs still queued, one
after another in start order, each at the earliest time at or after the previous one's start when
it fits. Running jobs, and jobs planned to start, free their nodes at the end of their duration
limit; a job without a limit holds its nodes for good. Jobs usually end before their limit, so an
estimate tends to be late rather than early, but backfilled jobs and later higher-priority
submissions can move it either way.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec
from libs.contracts.scheduling import Prediction
from services.scheduler.placement import (
    Capacity,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    choose,
    holdings,
    schedule,
)

NEW_JOB = "(new job)"  # the id a predicted job gets; real job ids look like job-<12 hex digits>


@dataclass(frozen=True)
class Plan:
    """When one queued job is expected to start, and what that depends on."""

    job_id: str
    start: datetime | None
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    # Known start: the jobs whose end lets it start. Unknown start: running jobs without a duration
    # limit it waits for.
    waits_for: list[str] = field(default_factory=list)
    blocked_by: str | None = None  # a job ahead of it whose start is unknown
    unplaceable: bool = False  # fits on no node of the cluster


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


def plan_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
               running: Sequence[RunningJob] = (), now: datetime, decision: Decision | None = None,
               until: str | None = None) -> dict[str, Plan]:
    """Plan every queued job (or those up to and including `until`), in start order.

    `decision` is this cycle's `schedule` result for the same inputs, when the caller has it already.
    """
    if decision is None:
        decision = schedule(queue, nodes, flavors, running=running, now=now)
    durations = {job.job_id: job.duration_seconds for job in queue}
    capacity = Capacity.of(nodes)
    releases: list[tuple[datetime, int, str, dict[str, Resources]]] = []  # a heap, by end
    order = itertools.count()  # keeps the heap from ever comparing holdings
    unlimited: list[tuple[str, dict[str, Resources]]] = []  # holders without a duration limit

    def hold(job_id: str, held: dict[str, Resources], ends: datetime | None) -> None:
        if ends is None:
            unlimited.append((job_id, held))
        else:
            heapq.heappush(releases, (max(ends, now), next(order), job_id, held))

    for holder in running:
        hold(holder.job_id, holdings(holder.placement, holder.flavor), holder.ends_at)
    plans: dict[str, Plan] = {}
    for admission in decision.admissions:
        held = holdings(admission.placement, flavors[admission.flavor])
        capacity.take(held)
        seconds = durations.get(admission.job_id)
        hold(admission.job_id, held, now + timedelta(seconds=seconds) if seconds is not None else None)
        plans[admission.job_id] = Plan(job_id=admission.job_id, start=now, flavor=admission.flavor,
                                       placement=admission.placement)

    unplaceable = set(decision.unplaceable)
    clock = now
    released_last: list[str] = []  # the jobs whose end moved the clock to where it is
    blocked: str | None = None
    for job in queue:
        if job.job_id in plans:
            pass
        elif job.job_id in unplaceable:
            plans[job.job_id] = Plan(job_id=job.job_id, start=None, unplaceable=True)
        elif blocked is not None:
            plans[job.job_id] = Plan(job_id=job.job_id, start=None, blocked_by=blocked)
        else:
            while (choice := choose(capacity, job.spec, flavors)) is None and releases:
                clock = releases[0][0]
                released_last = []
                while releases and releases[0][0] == clock:
                    _, _, ended, held = heapq.heappop(releases)
                    capacity.give(held)
                    released_last.append(ended)
            if choice is None:
                blocked = job.job_id
                plans[job.job_id] = Plan(job_id=job.job_id, start=None,
                                         waits_for=_unlimited_holders(capacity, job.spec, flavors, unlimited))
            else:
                flavor_name, placement = choice
                held = holdings(placement, flavors[flavor_name])
                capacity.take(held)
                hold(job.job_id, held,
                     clock + timedelta(seconds=job.duration_seconds) if job.duration_seconds is not None else None)
                plans[job.job_id] = Plan(job_id=job.job_id, start=clock, flavor=flavor_name, placement=placement,
                                         waits_for=list(released_last) if clock > now else [])
        if job.job_id == until:
            break
    return plans


def _unlimited_holders(capacity: Capacity, spec: JobSpec, flavors: dict[str, Flavor],
                       unlimited: list[tuple[str, dict[str, Resources]]]) -> list[str]:
    """The jobs without a duration limit that hold nodes this job could use."""
    usable: set[str] = set()
    for name in spec.flavors:
        if name in flavors:
            usable.update(capacity.cluster.eligible(spec, flavors[name])[1])
    return sorted({job_id for job_id, held in unlimited if usable.intersection(held)})


def predict_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
                  running: Sequence[RunningJob] = (), now: datetime) -> dict[str, datetime | None]:
    """The expected start of every queued job (None: unknown, or it fits on no node)."""
    return {job_id: plan.start for job_id, plan in
            plan_queue(queue, nodes, flavors, running=running, now=now).items()}


def predict(spec: JobSpec, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
            running: Sequence[RunningJob] = (), now: datetime, duration_seconds: int | None = None) -> Prediction:
    """S6: what would happen if `spec` were submitted now.

    The job joins the queue behind every job of the same or a higher priority. Jobs ahead of it that
    this cycle starts, or that fit on no node and so never block anyone, are not counted as ahead.
    """
    if duration_seconds is None:
        duration_seconds = spec.max_duration_seconds
    rank = PRIORITY_RANK[spec.priority]
    index = next((i for i, job in enumerate(queue) if PRIORITY_RANK[job.spec.priority] > rank), len(queue))
    ordered = [*queue[:index], QueuedJob(NEW_JOB, spec, duration_seconds), *queue[index:]]
    decision = schedule(ordered, nodes, flavors, running=running, now=now)
    admitted = {admission.job_id: admission for admission in decision.admissions}
    mine = admitted.get(NEW_JOB)
    if mine is not None:
        hosts = [p.node for p in mine.placement]
        workers = sum(1 for p in mine.placement if p.role == "worker")
        return Prediction(starts_now=True, flavor=mine.flavor, nodes=hosts, node_count=workers, predicted_at=now,
                          reason=f"Starts now with flavor {mine.flavor} on {', '.join(dict.fromkeys(hosts))}.")

    skipped = set(admitted).union(decision.unplaceable)  # started now, or never blocking it
    ahead = [job.job_id for job in queue[:index] if job.job_id not in skipped]
    plan = plan_queue(ordered, nodes, flavors, running=running, now=now, decision=decision, until=NEW_JOB)[NEW_JOB]
    position, jobs_ahead = len(ahead) + 1, len(ahead)

    def queued(reason: str, start: datetime | None = None) -> Prediction:
        workers = sum(1 for p in plan.placement if p.role == "worker")
        return Prediction(starts_now=False, flavor=plan.flavor, node_count=workers, position=position,
                          jobs_ahead=jobs_ahead, estimated_start=start, predicted_at=now, reason=reason)

    if plan.unplaceable:
        return queued(f"Fits on no node of this cluster with flavor {', '.join(spec.flavors)}, "
                      "even with every node free.")
    behind = f"Waits behind {jobs_ahead} job{'s' if jobs_ahead != 1 else ''}" if ahead else "First in line"
    if plan.start is None:
        if plan.blocked_by is not None:
            why = f"{plan.blocked_by} ahead of it waits for jobs without a duration limit"
        elif plan.waits_for:
            verb = "has" if len(plan.waits_for) == 1 else "have"
            why = f"it waits for {names(plan.waits_for)}, which {verb} no duration limit"
        else:
            why = "it waits for jobs without a duration limit"
        return queued(f"{behind}; its start cannot be estimated because {why}.")
    when = f"expected to start at {format_time(plan.start, now)}"
    if plan.waits_for:
        when += f" when {names(plan.waits_for)} {'ends' if len(plan.waits_for) == 1 else 'end'}"
    return queued(f"{behind}; {when}.", plan.start)
