"""What a scheduling cycle records (pure rules: the state and `now` in, the events out).

A cycle first stops jobs past their duration limit (J16) and fails checkpoint-resume jobs whose
failure no node fault explained in time (J12); then, on the state with those recorded, it admits
what the decision logic (placement.py) places and grows shrunken elastic jobs (S4, S10).
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

from libs.contracts.cluster import Flavor, NodeInfo
from libs.contracts.events import (
    JobAdmitted,
    JobExpiring,
    JobFailed,
    JobPrechecking,
    JobPredicted,
    JobRescaling,
)
from libs.eventstore import NewEvent
from libs.placement import (
    CYCLE_DEPTH,
    Admission,
    Cluster,
    Decision,
    Growth,
    NodeCapacity,
    may_grow,
    schedule,
)
from libs.settings import Settings
from services.scheduler.domain.arrays import held_back
from services.scheduler.domain.names import job_change
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.planning.decision_inputs import (
    cluster_flavors,
    node_capacity,
    queued_job,
    running_jobs_changed,
)
from services.scheduler.planning.prediction import started


def settle_time(settings: Settings) -> timedelta:
    """How long a checkpoint-resume job's failure waits for a node fault to explain it: long enough
    for a dead node to be declared lost."""
    return timedelta(seconds=settings.node_lost_seconds + 4 * settings.heartbeat_seconds)


def seconds_to_wait(state: SchedulerState, now: datetime, *, cycle_seconds: float, settle: timedelta) -> float:
    """Until the next cycle, duration limit or settled failure, whichever comes first."""
    deadlines = [(j.ends_at - now).total_seconds() for j in state.running()
                 if j.ends_at is not None and not j.expiring]
    deadlines += [(j.unexplained_failure[1] + settle - now).total_seconds() for j in state.running()
                  if j.unexplained_failure is not None]
    return max(0.05, min([cycle_seconds, *deadlines]))


def expirations(state: SchedulerState, now: datetime) -> list[NewEvent]:
    """J16: a running job past its duration limit is stopped and will end `expired`."""
    return [job_change(JobExpiring(job_id=job.job_id, attempt=job.attempt, limit_seconds=job.duration_seconds or 0))
            for job in state.running()
            if job.ends_at is not None and job.ends_at <= now and not job.expiring and job.stop_requested_by is None]


def settled_failures(state: SchedulerState, now: datetime, settle: timedelta) -> list[NewEvent]:
    """J12: a checkpoint-resume job that failed with no node fault reported within the settle time
    failed on its own."""
    changes: list[NewEvent] = []
    for job in state.running():
        if job.unexplained_failure is None or job.moving:
            continue
        failure, failed_at = job.unexplained_failure
        if failed_at + settle <= now:
            changes.append(job_change(JobFailed(job_id=job.job_id, reason=failure.reason,
                                                exit_code=failure.exit_code)))
    return changes


# The `Cluster` of the last cycle, with what it worked out about its nodes (the nodes each kind of rank may use,
# which job shapes fit the empty cluster at all): the next cycle over the same nodes and flavors reuses it, instead of
# working it out again over every node. A node that registers, is lost or comes back makes a new one.
_last_cluster: list[tuple[tuple[NodeInfo, ...], dict[str, Flavor], Cluster]] = []


def cluster_of(nodes: list[NodeCapacity], flavors: dict[str, Flavor]) -> Cluster:
    """The cluster of these nodes and flavors: the last cycle's when they are the same."""
    infos = tuple(node.info for node in nodes)
    if _last_cluster and _last_cluster[0][0] == infos and _last_cluster[0][1] == flavors:
        return _last_cluster[0][2]
    cluster = Cluster(infos)
    _last_cluster[:] = [(infos, dict(flavors), cluster)]
    return cluster


def decide(state: SchedulerState, now: datetime) -> Decision | None:
    """The cycle's decision on the queue and the growable jobs; None when no job could start or grow."""
    waiting = state.queue()
    held = held_back(state, (job.job_id for job in waiting))  # arrays at their `%N`: the rest wait
    nodes = node_capacity(state)
    cluster = cluster_of(nodes, cluster_flavors(state))
    served = cluster.served  # a job no node could take does not count against the depth
    queue = [queued_job(state, job, now) for job in itertools.islice(
        (job for job in waiting if job.job_id not in held and served.may_serve(job.spec)), CYCLE_DEPTH)]
    running, change = running_jobs_changed(state, now)
    if not queue and not any(map(may_grow, running)):
        return None
    return schedule(queue, nodes, cluster_flavors(state), running=running, now=now, cluster=cluster,
                    running_change=change)


def admissions(state: SchedulerState, decision: Decision, now: datetime) -> list[NewEvent]:
    """Each admission; a job admitted before its prediction was planned (S6) has it recorded first: it starts
    now, where it is placed."""
    changes: list[NewEvent] = []
    for admission in decision.admissions:
        if admission.job_id in state.unpredicted:
            prediction = started(admission.flavor, admission.placement, now).prediction
            changes.append(job_change(JobPredicted(job_id=admission.job_id, prediction=prediction)))
        changes.append(job_change(admission_event(state.jobs[admission.job_id], admission)))
    return changes


def growths(state: SchedulerState, decision: Decision) -> list[NewEvent]:
    return [job_change(growth_event(state.jobs[growth.job_id], growth)) for growth in decision.growths]


def admission_event(job: Job, admission: Admission) -> JobAdmitted | JobPrechecking:
    """A placed job starts, unless it resumes from checkpoints (J12): its nodes are pre-checked first (M1)."""
    if job.spec.checkpoint_resume is not None:
        return JobPrechecking(job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                              placement=admission.placement, dropped_flavors=admission.dropped_flavors)
    return JobAdmitted(job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                       placement=admission.placement, dropped_flavors=admission.dropped_flavors,
                       backfilled=admission.backfilled)


def growth_event(job: Job, growth: Growth) -> JobRescaling:
    """S10: the job's attempt is stopped, and the next one starts on the bigger placement."""
    workers = sum(p.role == "worker" for p in job.placement)
    grown = sum(p.role == "worker" for p in growth.placement)
    return JobRescaling(job_id=job.job_id, attempt=job.attempt, flavor=growth.flavor, placement=growth.placement,
                        reason=f"grows from {workers} to {grown} nodes now that resources are free")
