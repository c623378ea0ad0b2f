"""What the decision logic sees of the scheduler's state: the inputs of a cycle, of `why` and of a
prediction, read from the state at one moment (`now` is a parameter, never a clock read)."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.placement import NodeCapacity, QueuedJob, RunningChange, RunningJob
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.planning.prediction_cache import JobFacts, PlanInputs

# M1: nodes that failed a job's pre-check are not tried for it again until this long after.
RECHECK_AFTER = timedelta(seconds=60)


def node_capacity(state: SchedulerState) -> list[NodeCapacity]:
    """The schedulable nodes, in the state's order, and what is free on each: made again only for the nodes where
    what is held changed since the last time (all of them after a node event), and the same objects as last time
    for the others, so that a cycle over the same nodes sees at once which changed (`Capacity.update`)."""
    changed, made, at = state.capacity_changed, state.capacity_as, state.capacity_at
    if changed is None:
        made[:] = [_free_on(state, name, node.info) for name, node in state.nodes.items() if node.schedulable]
        at.clear()
        at.update((node.info.name, place) for place, node in enumerate(made))
    else:
        for name in changed:
            place = at.get(name)
            if place is not None:  # (a node that is not schedulable has nothing held on it to change)
                made[place] = _free_on(state, name, made[place].info)
        changed.clear()
    state.capacity_changed = changed if changed is not None else set()
    return list(made)


def _free_on(state: SchedulerState, name: str, info: NodeInfo) -> NodeCapacity:
    used = state.used_on(name)
    return NodeCapacity(info=info, free=Resources.of_node(info) - (Resources() if used is None else used))


def cluster_flavors(state: SchedulerState) -> dict[str, Flavor]:
    return state.flavors


def queued_jobs(state: SchedulerState, now: datetime) -> list[QueuedJob]:
    return [queued_job(state, job, now) for job in state.queue()]


def queued_job(state: SchedulerState, job: Job, now: datetime) -> QueuedJob:
    """A queued job as the decision logic sees it: the one made before, unless what it is made from changed."""
    made = job.queued_as
    # Made since the job's last event, it still holds unless it depends on the time (nodes avoided for a while
    # after a failed pre-check) or on the nodes' dataset caches.
    if made is not None and job.failed_precheck is None and not job.spec.data_preparation:
        return made
    duration, avoided, prefer = job.duration_seconds, state.avoided_nodes(job, now, RECHECK_AFTER), \
        state.data_on_nodes(job.spec)
    if (made is None or made.spec.priority != job.priority or made.duration_seconds != duration
            or made.excluded_nodes != avoided or made.prefer != prefer):
        # The decision logic reads priority from the spec: give it the current one (S3).
        spec = job.spec if job.spec.priority == job.priority else msgspec.structs.replace(job.spec,
                                                                                          priority=job.priority)
        made = job.queued_as = QueuedJob(job.job_id, spec, duration, avoided, prefer=prefer)
    return made


def running_jobs(state: SchedulerState, now: datetime) -> list[RunningJob]:
    """Jobs that hold resources, as the decision logic sees them: running ones, and those being
    pre-checked (they hold their placement and, once admitted, run until their limit)."""
    running: list[RunningJob] = []
    for job in state.holding():
        made, _ = held_as(state, job, now)
        if made is not None:
            running.append(made)
    return running


def running_jobs_changed(state: SchedulerState, now: datetime) -> tuple[list[RunningJob], RunningChange | None]:
    """`running_jobs` for a cycle, made again only for the jobs whose events were folded since the last time (all of
    them after a state was read back), and how it differs from the list given then (None: made afresh), so that the
    cycle compares no lists (`RunningChange`)."""
    given = state.given_running
    made, before = given.made, given.listed
    change: RunningChange | None = None
    if given.changed is None or before is None:
        made.clear()
        given.every_time.clear()
        for job in state.holding():
            running, key = _given(state, job, now), state.holding_key(job.job_id)
            if running is not None and key is not None:
                made.put(running, key)
    else:
        gone, added = [], []
        for job_id in given.changed | given.every_time:
            key = state.holding_key(job_id)
            old, new = made.get(job_id), None if key is None else _given(state, state.jobs[job_id], now)
            if key is None:
                given.every_time.discard(job_id)
            if new is old:
                continue
            if old is not None:
                made.discard(job_id)
                gone.append(old)
            if new is not None and key is not None:
                made.put(new, key)
                added.append(new)
        change = RunningChange(before, gone, added)
    given.listed, given.changed = list(made.jobs), set()
    return given.listed, change


def _given(state: SchedulerState, job: Job, now: datetime) -> RunningJob | None:
    made, every_time = held_as(state, job, now)
    if every_time:
        state.given_running.every_time.add(job.job_id)
    else:
        state.given_running.every_time.discard(job.job_id)
    return made


def held_as(state: SchedulerState, job: Job, now: datetime) -> tuple[RunningJob | None, bool]:
    """A job holding resources as the decision logic sees it (None: it holds a flavor the cluster lacks), the one made
    before unless one of its events was folded since; and whether it is made again every time (a pre-checked job with
    a limit ends as if it started now)."""
    if (made := job.running_as) is not None:
        return made, False
    made = running_job(state, job, now)
    every_time = job.prechecking and job.duration_seconds is not None
    if made is not None and not every_time:
        job.running_as = made
    return made, every_time


def running_job(state: SchedulerState, job: Job, now: datetime) -> RunningJob | None:
    """A job holding resources as the decision logic sees it; None when it holds a flavor the cluster lacks."""
    held = state.placements(job)
    flavor = state.flavor(held[0][0]) if held else None
    if flavor is None:
        return None
    # A job being moved holds both placements until its next attempt starts.
    placement = [p for _, placement in held for p in placement]
    ends_at = job.ends_at
    if job.prechecking and job.duration_seconds is not None:  # as if it started now
        ends_at = now + timedelta(seconds=job.duration_seconds) - job.ran_before
    return RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=placement, ends_at=ends_at,
                      can_grow=job.status == "running" and not job.moving, excluded_nodes=frozenset(job.excluded_nodes))


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
