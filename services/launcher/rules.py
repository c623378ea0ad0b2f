"""The launcher's decisions, as pure functions of its state and a message: they return the events to
record and never talk to anyone (the dispatcher does, service.py records).

- `plan_admission`: an admitted attempt becomes its LaunchPlanned (L1–L7, J3, J12): the shape every node's
  launch is derived from, with the rendezvous ports its nodes chose (`needs_ports` says which nodes to ask
  first).
- `record_report`: an agent's process report becomes process events and, when it settles the
  attempt, its outcome.
- `report_refusal`: why a report cannot be taken from where it came (another node's process).
- `give_up_node` and `stopped`: what the dispatcher's confirmations (or their absence) settle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from libs.contracts import subjects
from libs.contracts.agent import ProcessExited, ProcessStarted
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import (
    Event,
    JobAdmitted,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LaunchSucceeded,
    LostProcessesStopped,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    Placement,
)
from libs.contracts.jobspec import JobSpec
from libs.eventstore import NewEvent
from libs.jobusers import job_uid, unnamed_plan_uid
from services.launcher.planner import listening_ranks, plan_shape, ports_wanted
from services.launcher.state import Launch, LauncherState

LAUNCH = "launch"  # the launcher's aggregate: one per job (id = job id)


def launch_events(job_id: str, events: list[Event]) -> list[NewEvent]:
    return [NewEvent(LAUNCH, job_id, event) for event in events]


# --- admissions --------------------------------------------------------------------------------------


def plan_admission(state: LauncherState, cluster: ClusterConfig, job_id: str,
                   chosen: Mapping[str, Sequence[int]]) -> list[NewEvent]:
    """The launch plan of the job's admitted attempt not yet planned (none when there is none), with the
    rendezvous ports its nodes `chosen` (node -> ports, in rank order); the launcher's own choice for a node
    missing there."""
    admitted = state.unplanned.get(job_id)
    if admitted is None:
        return []
    return launch_events(job_id, [_plan(state, cluster, job_id, admitted.event, chosen)])


def _plan(state: LauncherState, cluster: ClusterConfig, job_id: str, admission: JobAdmitted,
          chosen: Mapping[str, Sequence[int]]) -> Event:
    spec = state.spec(job_id)
    flavor = cluster.flavor(admission.flavor)
    if spec is None or flavor is None:
        return LaunchFailed(job_id=job_id, attempt=admission.attempt,
                            reason=f"the launcher does not know the job's spec or flavor {admission.flavor}")
    ports = _rank_ports(state, spec, admission.placement, chosen)
    shape = plan_shape(spec, flavor, admission.placement, ports=ports, job_id=job_id,
                       attempt=admission.attempt, resumes=state.resumes(job_id), image=state.image(job_id),
                       run_as=_user_of(state, cluster, job_id))
    return LaunchPlanned(job_id=job_id, attempt=admission.attempt, mode=spec.mode, shape=shape)


def _user_of(state: LauncherState, cluster: ClusterConfig, job_id: str) -> int:
    """L1: the user the job's processes run as. A job keeps the user its earlier attempt ran as, whatever the
    cluster config says since: a resumed or restarted attempt writes where the earlier ones wrote."""
    earlier = state.launches.get(job_id)
    if earlier is None:
        return job_uid(cluster.job_users, job_id, state.creator(job_id))
    plan = earlier.plan
    ran_as = plan.shape.run_as if plan.shape is not None else next(
        (launch.run_as for launch in plan.every() if launch.run_as is not None), None)
    return ran_as if ran_as is not None else unnamed_plan_uid(job_id)


def _rank_ports(state: LauncherState, spec: JobSpec, placement: list[Placement],
                chosen: Mapping[str, Sequence[int]]) -> dict[int, int]:
    """Each listening rank's port: its node's choice in rank order, or the launcher's for a node that chose
    too few."""
    ranks = listening_ranks(spec, placement)
    nodes = {place.rank: place.node for place in placement}
    wanted = ports_wanted(spec, placement)
    offered = {node: list(ports) for node, ports in chosen.items() if len(ports) >= wanted.get(node, 0)}
    fallback = iter(state.fallback_ports(sum(count for node, count in wanted.items() if node not in offered)))
    ports: dict[int, int] = {}
    for rank in ranks:
        node = nodes[rank]
        ports[rank] = offered[node].pop(0) if node in offered else next(fallback)
    return ports


def needs_ports(state: LauncherState, cluster: ClusterConfig, job_id: str) -> dict[str, int]:
    """The nodes to ask for rendezvous ports before the job's unplanned attempt is planned, and how many
    each: none when the job's mode needs none, or when its plan cannot be made or would only be stopped."""
    admitted = state.unplanned.get(job_id)
    spec = state.spec(job_id)
    if admitted is None or spec is None or cluster.flavor(admitted.event.flavor) is None or job_id in state.ending:
        return {}
    return ports_wanted(spec, admitted.event.placement)


# --- agent reports --------------------------------------------------------------------------------------


def record_report(state: LauncherState, report: ProcessStarted | ProcessExited) -> list[NewEvent]:
    """What a report of the job's current attempt adds: a start or an exit once each, and the outcome."""
    launch = state.launches.get(report.job_id)
    if launch is None or launch.attempt != report.attempt:
        return []
    return launch_events(launch.job_id, _report_events(state, launch, report))


def report_refusal(state: LauncherState, report: ProcessStarted | ProcessExited, subject: str) -> str | None:
    """Why a report published on `subject` cannot be taken (None: it can): it must come from the node it names
    (the subject's, which NATS binds to the publishing agent), and a report of the job's current attempt must
    be about a process the plan put on that node, so no node ends or starts another node's process."""
    if (why := subjects.sender_refusal(subject, report.node)) is not None:
        return why
    launch = state.launches.get(report.job_id)
    if launch is None or launch.attempt != report.attempt:
        return None  # nothing is recorded of it (`record_report`)
    unit = (report.task, report.rank)
    planned = launch.plan.placed.get(unit, (None, None))[0]
    if planned is None:
        return f"{report.job_id} attempt {report.attempt} has no task {report.task} rank {report.rank}"
    if planned != report.node:
        return (f"node {report.node} reported task {report.task} rank {report.rank} of {report.job_id} attempt "
                f"{report.attempt}, which runs on {planned}")
    return None


def _started(launch: Launch, report: ProcessStarted) -> list[Event]:
    """The start of a unit not known to have started or ended yet."""
    unit = (report.task, report.rank)
    if unit in launch.started or unit in launch.exited:
        return []
    return [NodeProcessStarted(job_id=launch.job_id, attempt=launch.attempt, task=report.task, rank=report.rank,
                               node=report.node, pid=report.pid, backend=report.backend, staged=list(report.staged),
                               image=report.image, image_unpacked=report.image_unpacked,
                               started_at=report.started_at)]


def _report_events(state: LauncherState, launch: Launch, report: ProcessStarted | ProcessExited) -> list[Event]:
    unit = (report.task, report.rank)
    if isinstance(report, ProcessStarted):
        return _started(launch, report)
    if unit in launch.exited:
        return []
    # A start reported with the exit is recorded first, in the same append.
    started = _started(launch, report.started) if report.started is not None else []
    events: list[Event] = [*started, NodeProcessExited(job_id=launch.job_id, attempt=launch.attempt, task=report.task,
                                                       rank=report.rank, node=report.node, exit_code=report.exit_code,
                                                       exited_at=report.exited_at)]
    if launch.outcome is not None:
        return events
    if state.stop_wanted(launch):
        return events  # LaunchStopped is recorded once every node confirmed the stop
    if launch.role(unit) != "worker" and launch.task_done(report.task):
        return events  # a finished task's parameter server or standby, stopped on purpose
    if report.exit_code != 0:
        task = f"task {report.task + 1}: " if len(launch.tasks()) > 1 else ""
        if report.node_fault is not None:  # it never started, for a fault of its node (J14)
            events.append(LaunchFailed(job_id=launch.job_id, attempt=launch.attempt, exit_code=report.exit_code,
                                       reason=f"{task}rank {report.rank} could not start: {report.node_fault}",
                                       fault_nodes=[report.node]))
            return events
        if report.not_started is not None:  # it never started, for a fault of the job's own (its data, say)
            events.append(LaunchFailed(job_id=launch.job_id, attempt=launch.attempt, exit_code=report.exit_code,
                                       reason=f"{task}rank {report.rank} could not start: {report.not_started}"))
            return events
        events.append(LaunchFailed(
            job_id=launch.job_id, attempt=launch.attempt, exit_code=report.exit_code,
            reason=f"{task}rank {report.rank} on {report.node} exited with code {report.exit_code}"))
        return events
    # Parameter servers serve until the workers are done; the dispatcher then stops them. A batch
    # job's next task starts once this one is done (the dispatcher finds its units pending).
    if launch.finished_with(unit, report.exit_code):
        events.append(LaunchSucceeded(job_id=launch.job_id, attempt=launch.attempt))
    return events


# --- what the agents' answers settle --------------------------------------------------------------------


def give_up_node(launch: Launch, node: str, reason: str) -> list[NewEvent]:
    """A node that cannot answer leaves its processes' fate unknown: they are recorded lost."""
    return launch_events(launch.job_id, [
        NodeProcessLost(job_id=launch.job_id, attempt=launch.attempt, task=task, rank=rank, node=node, reason=reason)
        for task, rank in launch.running() if launch.node((task, rank)) == node])


def fenced(job_id: str, attempt: int, node: str) -> list[NewEvent]:
    """The node came back and stopped what was given up there."""
    return launch_events(job_id, [LostProcessesStopped(job_id=job_id, attempt=attempt, node=node)])


def stopped(state: LauncherState, launch: Launch, confirmed: set[str]) -> list[NewEvent]:
    """A launch to be reported stopped is, once every node confirmed the stop and no process still runs."""
    if not state.reports_stop(launch) or launch.running():
        return []
    if not set(launch.node_names) <= confirmed:
        return []
    return launch_events(launch.job_id, [LaunchStopped(job_id=launch.job_id, attempt=launch.attempt)])
