"""What the decision logic sees of the scheduler's state: the inputs of a cycle, of `why` and of a
prediction, read from the state at one moment (`now` is a parameter, never a clock read)."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from libs.contracts.cluster import Flavor, Resources
from libs.placement import NodeCapacity, QueuedJob, RunningJob
from services.scheduler.prediction_cache import JobFacts, PlanInputs
from services.scheduler.state import SchedulerState

# M1: nodes that failed a job's pre-check are not tried for it again until this long after.
RECHECK_AFTER = timedelta(seconds=60)


def node_capacity(state: SchedulerState) -> list[NodeCapacity]:
    """The schedulable nodes and what is free on each."""
    used = state.used()
    return [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
            for name, n in state.nodes.items() if n.schedulable]


def cluster_flavors(state: SchedulerState) -> dict[str, Flavor]:
    return {f.name: f for f in state.cluster.flavors}


def queued_jobs(state: SchedulerState, now: datetime) -> list[QueuedJob]:
    # The decision logic reads priority from the spec: give it the current one (S3).
    return [QueuedJob(j.job_id, j.spec if j.spec.priority == j.priority
                      else msgspec.structs.replace(j.spec, priority=j.priority), j.duration_seconds,
                      state.avoided_nodes(j, now, RECHECK_AFTER), prefer=state.data_on_nodes(j.spec))
            for j in state.queue()]


def running_jobs(state: SchedulerState, now: datetime) -> list[RunningJob]:
    """Jobs that hold resources, as the decision logic sees them: running ones, and those being
    pre-checked (they hold their placement and, once admitted, run until their limit)."""
    running: list[RunningJob] = []
    for job in state.holding():
        held = state.placements(job)
        flavor = state.flavor(held[0][0]) if held else None
        if flavor is None:
            continue
        # A job being moved holds both placements until its next attempt starts.
        placement = [p for _, placement in held for p in placement]
        ends_at = job.ends_at
        if job.prechecking and job.duration_seconds is not None:  # as if it started now
            ends_at = now + timedelta(seconds=job.duration_seconds) - job.ran_before
        running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=placement,
                                  ends_at=ends_at, can_grow=job.status == "running" and not job.moving,
                                  excluded_nodes=frozenset(job.excluded_nodes)))
    return running


def plan_inputs(state: SchedulerState, now: datetime) -> PlanInputs:
    """What a prediction plans from, copied: the plan runs in a worker thread while the event loop
    changes the state."""
    queue, running = queued_jobs(state, now), running_jobs(state, now)
    jobs = state.jobs
    facts = {held.job_id: JobFacts.of(jobs[held.job_id]) for held in running}
    for queued in queue:  # its limit is parsed already
        job = jobs[queued.job_id]
        facts[job.job_id] = JobFacts(job.spec, job.creator, job.flavor, job.started_at, job.ended_at,
                                     queued.duration_seconds)
    return PlanInputs(queue=queue, nodes=node_capacity(state), flavors=cluster_flavors(state), running=running,
                      jobs=facts)
