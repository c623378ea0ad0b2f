"""The launcher's decisions, as pure functions of its state and a message: they return the events to
record and never talk to anyone (the dispatcher does, service.py records).

- `plan_admission`: a JobAdmitted becomes the LaunchPlanned of the new attempt (L1–L7, J3, J12).
- `record_report`: an agent's process report becomes process events and, when it settles the
  attempt, its outcome.
- `give_up_node` and `stopped`: what the dispatcher's confirmations (or their absence) settle.
"""

from __future__ import annotations

from libs.contracts.agent import ProcessExited, ProcessStarted
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LaunchSucceeded,
    LostProcessesStopped,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
)
from libs.eventstore import NewEvent
from services.launcher.planner import plan_launch
from services.launcher.state import Launch, LauncherState

LAUNCH = "launch"  # the launcher's aggregate: one per job (id = job id)


def launch_events(job_id: str, events: list[Event]) -> list[NewEvent]:
    return [NewEvent(LAUNCH, job_id, event) for event in events]


# --- scheduler events -----------------------------------------------------------------------------------


def plan_admission(state: LauncherState, cluster: ClusterConfig, envelope: EventEnvelope) -> list[NewEvent]:
    """A new attempt the scheduler admitted gets its launch plan (an attempt planned already, none)."""
    admission = envelope.event
    if not isinstance(admission, JobAdmitted):
        return []
    job_id = envelope.aggregate_id
    launch = state.launches.get(job_id)
    if launch is not None and launch.attempt >= admission.attempt:
        return []
    return launch_events(job_id, [_plan(state, cluster, job_id, admission)])


def _plan(state: LauncherState, cluster: ClusterConfig, job_id: str, admission: JobAdmitted) -> Event:
    spec = state.spec(job_id)
    flavor = cluster.flavor(admission.flavor)
    if spec is None or flavor is None:
        return LaunchFailed(job_id=job_id, attempt=admission.attempt,
                            reason=f"the launcher does not know the job's spec or flavor {admission.flavor}")
    base_port = state.free_ports(len(admission.placement))
    nodes = plan_launch(spec, flavor, admission.placement, master_port=base_port, job_id=job_id,
                        attempt=admission.attempt, resumes=state.resumes(job_id))
    return LaunchPlanned(job_id=job_id, attempt=admission.attempt, mode=spec.mode, nodes=nodes, base_port=base_port)


# --- agent reports --------------------------------------------------------------------------------------


def record_report(state: LauncherState, report: ProcessStarted | ProcessExited) -> list[NewEvent]:
    """What a report of the job's current attempt adds: a start or an exit once each, and the outcome."""
    launch = state.launches.get(report.job_id)
    if launch is None or launch.attempt != report.attempt:
        return []
    return launch_events(launch.job_id, _report_events(state, launch, report))


def _report_events(state: LauncherState, launch: Launch, report: ProcessStarted | ProcessExited) -> list[Event]:
    unit = (report.task, report.rank)
    if isinstance(report, ProcessStarted):
        if unit in launch.started or unit in launch.exited:
            return []
        return [NodeProcessStarted(job_id=launch.job_id, attempt=launch.attempt, task=report.task, rank=report.rank,
                                   node=report.node, pid=report.pid, backend=report.backend)]
    if unit in launch.exited:
        return []
    events: list[Event] = [NodeProcessExited(job_id=launch.job_id, attempt=launch.attempt, task=report.task,
                                             rank=report.rank, node=report.node, exit_code=report.exit_code,
                                             exited_at=report.exited_at)]
    if launch.outcome is not None:
        return events
    if state.stop_wanted(launch):
        return events  # LaunchStopped is recorded once every node confirmed the stop
    if launch.node_of(unit).role != "worker" and launch.task_done(report.task):
        return events  # a finished task's parameter server or standby, stopped on purpose
    if report.exit_code != 0:
        task = f"task {report.task + 1}: " if len(launch.tasks()) > 1 else ""
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
        for task, rank in launch.running() if launch.node_of((task, rank)).node == node])


def fenced(job_id: str, attempt: int, node: str) -> list[NewEvent]:
    """The node came back and stopped what was given up there."""
    return launch_events(job_id, [LostProcessesStopped(job_id=job_id, attempt=attempt, node=node)])


def stopped(state: LauncherState, launch: Launch, confirmed: set[str]) -> list[NewEvent]:
    """A launch to be reported stopped is, once every node confirmed the stop and no process still runs."""
    if not state.reports_stop(launch) or launch.running():
        return []
    if not {n.node for n in launch.nodes} <= confirmed:
        return []
    return launch_events(launch.job_id, [LaunchStopped(job_id=launch.job_id, attempt=launch.attempt)])
