"""What the scheduler records in answer to the launcher's, the monitor's and the autoscaler's events (pure
rules).

Each rule takes the state, with the upstream event already folded in, and returns the events to
record; the base records them with the upstream message's tracking position, so each answer is
recorded exactly once.
"""

from __future__ import annotations

from libs.contracts.cluster import Resources
from libs.contracts.events import (
    EventEnvelope,
    InstanceDraining,
    JobAdmitted,
    JobEvent,
    JobExpired,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobRequeued,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobSucceeded,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeDrained,
    NodeLost,
    NodeUnhealthy,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
)
from libs.eventstore import NewEvent
from libs.placement import Capacity, NodeCapacity, choose
from services.scheduler.domain.names import drain_change, job_change
from services.scheduler.domain.state import Job, SchedulerState


def react(state: SchedulerState, envelope: EventEnvelope) -> list[NewEvent]:
    """What the scheduler records in answer to a launcher, monitor or autoscaler event (folded into `state`
    already)."""
    if isinstance(envelope.event, InstanceDraining):
        return drained(state, envelope.event)
    return [job_change(event) for event in _answer(state, envelope)]


def drained(state: SchedulerState, draining: InstanceDraining) -> list[NewEvent]:
    """A3: the fold made the node unschedulable; saying so in the scheduler's own log puts every admission to
    it before this answer, so the autoscaler, having read up to it, knows whether the node is idle."""
    return [drain_change(NodeDrained(node_name=draining.node, instance=draining.instance))]


def _answer(state: SchedulerState, envelope: EventEnvelope) -> list[JobEvent]:
    event = envelope.event
    if isinstance(event, NodeLost | NodeUnhealthy):
        return node_fault(state, event)
    if isinstance(event, PrecheckCompleted):
        return precheck_result(state, event)
    if isinstance(event, PerformanceDegraded):
        return slow_node(state, event)
    if not isinstance(event, LaunchSucceeded | LaunchFailed | LaunchStopped):
        return []
    job = state.jobs.get(event.job_id)
    if job is None or job.status != "running" or job.attempt != event.attempt:
        return []
    if isinstance(event, LaunchSucceeded):
        return [JobSucceeded(job_id=job.job_id)]
    if isinstance(event, LaunchFailed):
        return launch_failed(state, job, event)
    return launch_stopped(state, job)


def may_resume(job: Job) -> bool:
    """J12: a running checkpoint-resume job not already being stopped can be moved."""
    return job.status == "running" and job.spec.checkpoint_resume is not None and not job.moving


def node_fault(state: SchedulerState, event: NodeLost | NodeUnhealthy) -> list[JobEvent]:
    """M2: checkpoint-resume jobs on a lost or unhealthy node are moved; other jobs fail only when the
    node is lost. A job still being pre-checked waits for the monitor's verdict."""
    node = event.node_name
    lost = isinstance(event, NodeLost)
    reason = (f"node {node} was lost: {event.reason}" if isinstance(event, NodeLost)
              else f"node {node} is unhealthy: {', '.join(event.problems) or 'a component is faulty'}")
    changes: list[JobEvent] = []
    for job in state.jobs_on(node):
        if job.spec.checkpoint_resume is not None:
            if may_resume(job):
                changes.append(JobResuming(job_id=job.job_id, attempt=job.attempt, reason=reason,
                                           lost_nodes=[node] if lost else [], fault_nodes=[node]))
        elif lost:
            changes.append(JobFailed(job_id=job.job_id, reason=reason))
    return changes


def precheck_result(state: SchedulerState, event: PrecheckCompleted) -> list[JobEvent]:
    """M1: a job whose nodes passed starts there (unless one went down since); else it queues again."""
    job = state.jobs.get(event.job_id)
    if job is None or not job.prechecking or job.precheck is None or job.precheck.attempt != event.attempt:
        return []
    precheck = job.precheck
    if event.passed:
        # A node may have gone down since it was checked: then the job must not start there.
        down = state.unusable(precheck.placement)
        if down:
            return [JobPrecheckFailed(job_id=job.job_id, attempt=event.attempt, nodes=down,
                                      reason=f"since the pre-check passed, {node_states(state, down)}")]
        return [JobAdmitted(job_id=job.job_id, attempt=precheck.attempt, flavor=precheck.flavor,
                            placement=precheck.placement, dropped_flavors=precheck.dropped_flavors)]
    failed = [check for check in event.nodes if not check.passed]
    details = "; ".join(f"{check.node}: {', '.join(check.problems()) or 'did not pass'}" for check in failed)
    return [JobPrecheckFailed(job_id=job.job_id, attempt=event.attempt,
                              reason="the pre-check failed" + (f" on {details}" if details else ""),
                              nodes=[check.node for check in failed])]


def slow_node(state: SchedulerState, event: PerformanceDegraded) -> list[JobEvent]:
    """M6: with the action "reschedule", a job slow on a node is moved, and never placed there again."""
    job = state.jobs.get(event.job_id)
    if event.action != "reschedule" or job is None or job.attempt != event.attempt or not may_resume(job):
        return []
    reason = (f"it is slow on node {event.node}: hardware time / e2e time was {event.ratio:.3g} over "
              f"{event.window} iterations, {event.direction} its threshold of {event.threshold:g}")
    return [JobResuming(job_id=job.job_id, attempt=job.attempt, reason=reason, exclude_nodes=[event.node],
                        fault_nodes=[event.node])]


def launch_failed(state: SchedulerState, job: Job, event: LaunchFailed) -> list[JobEvent]:
    if job.resuming is not None:
        return []  # the attempt is being stopped after a fault anyway: its stop decides what follows
    if event.fault_nodes and job.stop_requested_by is None and not job.expiring:
        return not_started_there(state, job, event)
    if job.spec.checkpoint_resume is not None and job.stop_requested_by is None and not job.expiring:
        # When a node dies, its peers' collectives fail at once, before its heartbeats are missed: a
        # fault seen on one of the job's nodes now, or within the settle time, explains the failure.
        down = state.unusable(job.placement)
        if not down:
            return []  # cycle.settled_failures decides once the fault would have been seen
        lost = [n for n in down if (node := state.nodes.get(n)) is not None and node.lost]
        return [JobResuming(job_id=job.job_id, attempt=job.attempt, lost_nodes=lost, fault_nodes=list(down),
                            reason=f"{event.reason}, and {node_states(state, down)}")]
    restart = job.spec.fault_restart
    if restart is None or job.stop_requested_by is not None or job.expiring:
        return [JobFailed(job_id=job.job_id, reason=event.reason, exit_code=event.exit_code)]
    if job.restarts >= restart.max_restarts:
        reason = f"{event.reason}; it was already restarted {_times(job.restarts)}, its maximum"
        return [JobFailed(job_id=job.job_id, reason=reason, exit_code=event.exit_code)]
    # J13/M5: the rest of the attempt is stopped; its LaunchStopped starts the next one.
    return [JobRestarting(job_id=job.job_id, attempt=job.attempt, restarts=job.restarts + 1,
                          reason=event.reason, exit_code=event.exit_code)]


def not_started_there(state: SchedulerState, job: Job, event: LaunchFailed) -> list[JobEvent]:
    """J14: a rank could not start for a fault of its node (its data could not be prepared there). The job,
    whatever its kind, is tried on other nodes if some could serve it, without counting a resume; else it
    fails, saying why."""
    avoid = frozenset({*job.excluded_nodes, *event.fault_nodes})
    usable = [NodeCapacity(info=n.info, free=Resources.of_node(n.info)) for n in state.nodes.values() if not n.lost]
    flavors = {flavor.name: flavor for flavor in state.cluster.flavors}
    if choose(Capacity.of(usable), job.spec, flavors, avoid) is None:
        return [JobFailed(job_id=job.job_id, reason=f"{event.reason}; no other node could serve it",
                          exit_code=event.exit_code)]
    return [JobResuming(job_id=job.job_id, attempt=job.attempt, reason=event.reason, before_start=True,
                        exclude_nodes=list(event.fault_nodes), fault_nodes=list(event.fault_nodes))]


def launch_stopped(state: SchedulerState, job: Job) -> list[JobEvent]:
    """The attempt is down; why it was stopped decides what the job does next."""
    if job.stop_requested_by is not None:
        return [JobStopped(job_id=job.job_id, by=job.stop_requested_by)]
    if job.expiring:
        return [JobExpired(job_id=job.job_id, reason=f"ran past its duration limit of {job.duration}")]
    if job.resuming is not None and job.resuming.before_start:  # it never ran: not a resume
        return [JobRequeued(job_id=job.job_id, attempt=job.attempt, reason=job.resuming.reason, resumes=job.resumes)]
    if job.resuming is not None:
        resumes, limit = job.resumes, state.max_resumes(job) or 0
        if resumes >= limit:
            already = f"it already resumed {_times(resumes)}, its maximum" if resumes else "it may not resume"
            return [JobFailed(job_id=job.job_id, reason=f"{job.resuming.reason}; {already}")]
        return [JobRequeued(job_id=job.job_id, attempt=job.attempt, reason=job.resuming.reason, resumes=resumes + 1)]
    if job.restarting is not None:
        return [next_attempt(state, job, job.flavor or "", job.placement,
                             f"restart {job.restarts} after {job.restarting.reason}")]
    if job.rescaling is not None:
        # S10: the next attempt starts on the placement held for it.
        growth = job.rescaling
        following = next_attempt(state, job, growth.flavor, growth.placement, growth.reason)
        if isinstance(following, JobAdmitted) and job.spec.checkpoint_resume is not None:
            # M1: a checkpoint-resume job's nodes are pre-checked before every start on new nodes; it
            # leaves its old placement and holds the new one while the monitor checks it.
            return [JobRequeued(job_id=job.job_id, attempt=job.attempt, resumes=job.resumes,
                                reason=f"{growth.reason}; its nodes are pre-checked first"),
                    JobPrechecking(job_id=job.job_id, attempt=job.attempt + 1, flavor=growth.flavor,
                                   placement=growth.placement, dropped_flavors=job.dropped_flavors)]
        return [following]
    return [JobFailed(job_id=job.job_id, reason="its processes were stopped")]


def next_attempt(state: SchedulerState, job: Job, flavor: str, placement: list[Placement],
                 why: str) -> JobAdmitted | JobRequeued:
    """Start the next attempt on `placement` when all its nodes can take it; else wait in the queue."""
    down = state.unusable(placement)
    if down:
        return JobRequeued(job_id=job.job_id, attempt=job.attempt, resumes=job.resumes,
                           reason=f"{why}; {node_states(state, down)}, so it waits for other nodes")
    return JobAdmitted(job_id=job.job_id, attempt=job.attempt + 1, flavor=flavor, placement=placement,
                       dropped_flavors=job.dropped_flavors)


def node_states(state: SchedulerState, names: list[str]) -> str:
    """`node a is lost, node b is unhealthy (board:0 faulty)`."""
    parts = []
    for name in names:
        node = state.nodes.get(name)
        if node is None:
            parts.append(f"node {name} is unknown")
        elif node.lost:
            parts.append(f"node {name} is lost")
        else:
            parts.append(f"node {name} is unhealthy" + (f" ({', '.join(node.problems)})" if node.problems else ""))
    return ", ".join(parts)


def _times(count: int) -> str:
    return f"{count} time{'s' if count != 1 else ''}"
