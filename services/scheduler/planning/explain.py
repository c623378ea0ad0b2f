"""`trainyard why JOB`: what a queued job waits for, in terms a user can act on.

The report is worked out from the same snapshot and rules as a scheduling cycle: the jobs ahead, the
head's reservation, and for each flavor of the job which nodes it may use (S9), which have room now
and what the others are short of and who holds it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import FlavorWait, NodeShortage, WhyReport
from libs.placement import (
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    eligible,
    holdings,
    schedule,
    worker_counts,
)
from services.scheduler.planning.prediction import Forecast, forecast_queued, format_time, names

MAX_LISTED = 10


def explain(job_id: str, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
            running: Sequence[RunningJob] = (), now: datetime, all_nodes: list[NodeInfo] | None = None,
            unhealthy: Collection[str] = (), forecast: Forecast | None = None) -> WhyReport:
    """Why the queued job `job_id` has not started. `all_nodes` (unschedulable ones included) lets the
    report say that a node the job could use is lost, or unhealthy when it is in `unhealthy` (M2). `forecast`
    is the job's own, as the scheduler's predictions make it (likely and latest start); without it, the latest
    start is worked out here. Raises KeyError when the job is not in `queue`."""
    index = next((i for i, job in enumerate(queue) if job.job_id == job_id), None)
    if index is None:
        raise KeyError(job_id)
    job = queue[index]
    decision = schedule(queue, nodes, flavors, running=running, now=now)
    admitted = {a.job_id: a for a in decision.admissions}
    skipped = set(admitted).union(decision.unplaceable)
    ahead = [j.job_id for j in queue[:index] if j.job_id not in skipped]
    reservation = decision.reservation if decision.reservation and decision.reservation.job_id == job_id else None
    waits = [_flavor_wait(job, name, flavors.get(name), nodes, running, all_nodes, unhealthy)
             for name in job.spec.flavors]

    summary: list[str] = []
    if job_id in decision.unplaceable:
        summary.append(f"Fits on no node of this cluster: {'; '.join(_unplaceable_reasons(job.spec, waits))}.")
    elif job_id in admitted:
        admission = admitted[job_id]
        hosts = ", ".join(dict.fromkeys(p.node for p in admission.placement))
        summary.append(f"Can start now: the next scheduling cycle starts it with flavor {admission.flavor} on {hosts}.")
    else:
        if ahead:
            summary.append(f"Behind {len(ahead)} job{'s' if len(ahead) != 1 else ''} of higher or equal priority: "
                           f"{names(ahead, MAX_LISTED)}.")
        if reservation is not None:
            summary.append(_reservation_sentence(reservation.start, reservation.nodes, queue, decision, flavors,
                                                 running, now))
        usable = [n for n in nodes if n.info.name not in job.excluded_nodes]
        summary.extend(_wait_sentences(job.spec, waits, flavors, usable))
        if reservation is None and decision.reservation is not None and _room_now(job.spec, flavors, usable):
            summary.append(_blocked_by_head_sentence(job, decision, now))
        if reservation is None:
            # As `trainyard predict` tells it, from the same playthrough of the scheduler's cycles.
            if forecast is None:
                forecast = forecast_queued([job_id], queue, nodes, flavors, running=running, now=now)[job_id]
            if forecast.expectation:
                summary.append(f"{forecast.expectation[0].upper()}{forecast.expectation[1:]}.")
    if job_id not in decision.unplaceable:
        summary.extend(f"Flavor {wait.flavor}: {wait.note}." for wait in waits if wait.note)

    return WhyReport(
        job_id=job_id, status="queued", position=len(ahead) + 1, jobs_ahead=ahead[:MAX_LISTED],
        jobs_ahead_count=len(ahead), head=reservation is not None,
        reserved_start=reservation.start if reservation else None,
        reserved_nodes=list(reservation.nodes) if reservation else [], flavors=waits, summary=summary)


# --- one flavor -------------------------------------------------------------------------------------------


def _flavor_wait(job: QueuedJob, name: str, flavor: Flavor | None, nodes: list[NodeCapacity],
                 running: Sequence[RunningJob], all_nodes: list[NodeInfo] | None,
                 unhealthy: Collection[str]) -> FlavorWait:
    spec, excluded = job.spec, job.excluded_nodes
    if flavor is None:
        return FlavorWait(flavor=name, eligible_nodes=0, fitting_nodes=0, needed_nodes=spec.nodes,
                          note=f"{name} is not a flavor of this cluster")
    need = Resources.of_flavor(flavor)
    usable = [n for n in nodes if eligible(n.info, spec, flavor, excluded)]
    fitting = [n for n in usable if need.fits_in(n.free)]
    holders: dict[str, list[str]] = {}
    for holder in running:
        for node in dict.fromkeys(p.node for p in holder.placement):
            holders.setdefault(node, []).append(holder.job_id)
    shortages = [NodeShortage(node=n.info.name, missing=_missing(need, n.free),
                              held_by=sorted(holders.get(n.info.name, [])))
                 for n in sorted(usable, key=lambda n: n.info.name) if not need.fits_in(n.free)][:MAX_LISTED]
    notes = [] if usable else [_why_no_node(spec, flavor, [n.info for n in nodes])]
    if all_nodes is not None:
        schedulable = {n.info.name for n in nodes}
        down = sorted(i.name for i in all_nodes if i.name not in schedulable and eligible(i, spec, flavor, excluded))
        for state, group in (("lost", [n for n in down if n not in unhealthy]),
                             ("unhealthy", [n for n in down if n in unhealthy])):
            if group:
                notes.append(f"{names(group, MAX_LISTED)} could take it but {'is' if len(group) == 1 else 'are'} "
                             f"{state}")
    if excluded:
        notes.append(f"it may not use {names(sorted(excluded), MAX_LISTED)}: it was moved away from "
                     f"{'it' if len(excluded) == 1 else 'them'}, or {'it' if len(excluded) == 1 else 'they'} "
                     "failed its pre-check")
    return FlavorWait(flavor=name, eligible_nodes=len(usable), fitting_nodes=len(fitting), needed_nodes=spec.nodes,
                      shortages=shortages, note="; ".join(notes))


def _missing(need: Resources, free: Resources) -> list[str]:
    missing = []
    if need.cpus > free.cpus + 1e-9:
        missing.append(f"cpus: {free.cpus:g} free, {need.cpus:g} needed")
    if need.memory_mib > free.memory_mib:
        missing.append(f"memory: {free.memory_mib} MiB free, {need.memory_mib} MiB needed")
    if need.accelerators > free.accelerators:
        missing.append(f"accelerators: {free.accelerators} free, {need.accelerators} needed")
    return missing


def _why_no_node(spec: JobSpec, flavor: Flavor, infos: list[NodeInfo]) -> str:
    """Which S9 restriction leaves the job no node, checked in the order a user would fix them."""
    if spec.node_names:
        infos = [i for i in infos if i.name in spec.node_names]
        if not infos:
            return f"pinned to {names(spec.node_names, MAX_LISTED)}, and none of them is schedulable"
    if spec.pool is not None:
        infos = [i for i in infos if spec.pool in i.pools]
        where = f" in pool {spec.pool}"
        if not infos:
            return f"no schedulable node is in pool {spec.pool}"
    else:
        infos = [i for i in infos if not i.pools]
        where = ""
        if not infos:
            return "every schedulable node belongs to a dedicated pool, and the job names none"
    if flavor.accelerators and flavor.board is not None:
        infos = [i for i in infos if i.board == flavor.board]
        if not infos:
            return f"no schedulable node{where} has board {flavor.board}"
    if flavor.accelerators and spec.driver_version is not None:
        board = f" with board {flavor.board}" if flavor.board else ""
        return f"no schedulable node{where}{board} has driver version {spec.driver_version}"
    return "no schedulable node can take it"


def _describe(flavor: Flavor) -> str:
    parts = [f"{flavor.cpus:g} CPU{'s' if flavor.cpus != 1 else ''}", f"{flavor.memory_mib} MiB"]
    if flavor.accelerators:
        board = f" {flavor.board}" if flavor.board else ""
        parts.append(f"{flavor.accelerators}{board} accelerator{'s' if flavor.accelerators != 1 else ''}")
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _ranks_fitting(need: Resources, free: Resources, limit: int) -> int:
    count = 0
    while count < limit and need.fits_in(free):
        free, count = free - need, count + 1
    return count


def _room_now(spec: JobSpec, flavors: dict[str, Flavor], nodes: list[NodeCapacity]) -> bool:
    """Whether what is free now would hold the job's workers (at its smallest size) with some flavor."""
    smallest = worker_counts(spec)[-1]
    for name in spec.flavors:
        flavor = flavors.get(name)
        if flavor is not None:
            need = Resources.of_flavor(flavor)
            if sum(_ranks_fitting(need, n.free, smallest) for n in nodes if eligible(n.info, spec, flavor)) >= smallest:
                return True
    return False


# --- sentences --------------------------------------------------------------------------------------------


def _wait_sentences(spec: JobSpec, waits: list[FlavorWait], flavors: dict[str, Flavor],
                    nodes: list[NodeCapacity]) -> list[str]:
    sentences = []
    smallest = worker_counts(spec)[-1]
    for wait in waits:
        flavor = flavors.get(wait.flavor)
        if flavor is None or not wait.eligible_nodes:
            continue
        need = Resources.of_flavor(flavor)
        ranks = sum(_ranks_fitting(need, n.free, spec.nodes) for n in nodes if eligible(n.info, spec, flavor))
        short = spec.nodes - min(ranks, spec.nodes)
        if short == 0:
            continue
        more = f"{short} more node{'s' if short != 1 else ''}"
        elastic = f" (or {smallest - min(ranks, smallest)} more to start smaller)" if smallest < spec.nodes else ""
        sentences.append(f"Waits for {more} with {_describe(flavor)} free for flavor {wait.flavor}{elastic}: "
                         f"{wait.fitting_nodes} of {wait.eligible_nodes} eligible nodes "
                         f"fit{'s' if wait.fitting_nodes == 1 else ''} now.")
    return sentences


def _unplaceable_reasons(spec: JobSpec, waits: list[FlavorWait]) -> list[str]:
    reasons = []
    for wait in waits:
        if wait.note and not wait.eligible_nodes:
            reasons.append(f"flavor {wait.flavor}: {wait.note}")
        else:
            reasons.append(f"flavor {wait.flavor}: its {wait.eligible_nodes} eligible "
                           f"node{'s' if wait.eligible_nodes != 1 else ''} cannot hold {spec.nodes} "
                           f"rank{'s' if spec.nodes != 1 else ''} even when empty")
    return reasons


def _reservation_sentence(start: datetime | None, reserved: list[str], queue: list[QueuedJob],
                          decision: Decision, flavors: dict[str, Flavor], running: Sequence[RunningJob],
                          now: datetime) -> str:
    hosts = ", ".join(dict.fromkeys(reserved))
    durations = {j.job_id: j.duration_seconds for j in queue}
    # Who holds what until when: running jobs, and the jobs this cycle starts ahead of the head.
    holders: list[tuple[str, datetime | None, set[str]]] = [
        (r.job_id, max(r.ends_at, now) if r.ends_at is not None else None, set(holdings(r.placement, r.flavor)))
        for r in running]
    for admission in (a for a in decision.admissions if not a.backfilled):
        seconds = durations.get(admission.job_id)
        holders.append((admission.job_id, now + timedelta(seconds=seconds) if seconds is not None else None,
                        set(holdings(admission.placement, flavors[admission.flavor]))))
    if start is None:
        blocking = sorted(j for j, ends, on in holders if ends is None and on.intersection(reserved))
        why = f" because {names(blocking)} {'has' if len(blocking) == 1 else 'have'} no duration limit" \
            if blocking else ""
        return f"Reserved on {hosts}; the start is unknown{why}."
    ending = sorted(j for j, ends, _ in holders if ends == start)
    when = f" when {names(ending)} {'ends' if len(ending) == 1 else 'end'}" if ending else ""
    return f"Reserved to start at {format_time(start, now)} on {hosts}{when}."


def _blocked_by_head_sentence(job: QueuedJob, decision: Decision, now: datetime) -> str:
    assert decision.reservation is not None
    head = decision.reservation
    if head.start is None:
        return (f"Room is free now, but {head.job_id} ahead of it needs those nodes as soon as it can start, "
                "and that time is unknown.")
    sentence = (f"Room is free now, but starting it would delay {head.job_id}, reserved to start at "
                f"{format_time(head.start, now)}")
    if job.duration_seconds is None:
        return sentence + "; with a duration limit that ends before then it could start at once."
    return sentence + "; its duration limit runs past that, and the free room is on nodes reserved for it."
