"""The launcher's state: its launches (own events) and what it needs from the scheduler's events.

An attempt the scheduler stops is reported LaunchStopped once it is down. So is a failed attempt the
scheduler follows with a new one (a fault restart, J13; a resume, J12): the next attempt may only
start once the scheduler knows nothing of this one still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    JobExpiring,
    JobFailed,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LaunchSucceeded,
    NodeLaunch,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    SettingsChanged,
)
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import AdminSettings

FIRST_MASTER_PORT = 29500


Unit = tuple[int, int]
"""(task, rank): one process group of a launch. A regular job has task 0 only."""


@dataclass
class Launch:
    """One attempt of one job across its nodes (and, for a batch job, its tasks one after another)."""

    job_id: str
    attempt: int
    nodes: list[NodeLaunch]
    version: int
    started: dict[Unit, int] = field(default_factory=dict)  # -> pid
    exited: dict[Unit, int] = field(default_factory=dict)  # -> exit code
    lost: set[Unit] = field(default_factory=set)  # on nodes that stopped answering
    outcome: str | None = None  # succeeded | failed | stopped
    trace: dict[str, str] = field(default_factory=dict)  # the job's trace, continued by every call
    base_port: int = 0

    def ports(self) -> range:
        """One port per rank, as `free_ports` reserved them (a batch job's tasks share them in turn)."""
        return range(self.base_port, self.base_port + len({n.rank for n in self.nodes}))

    def running(self) -> list[Unit]:
        return [unit for unit in self.started if unit not in self.exited and unit not in self.lost]

    def task_done(self, task: int) -> bool:
        """Every worker of the task exited 0 (parameter servers are stopped afterwards)."""
        return all(self.exited.get((n.task, n.rank)) == 0 for n in self.nodes if n.task == task and n.role == "worker")

    def finished_with(self, unit: Unit, exit_code: int) -> bool:
        """Whether every worker of every task has exited 0 once `unit` exits with `exit_code`."""
        exited = {**self.exited, unit: exit_code}
        return all(exited.get((n.task, n.rank)) == 0 for n in self.nodes if n.role == "worker")

    def tasks(self) -> list[int]:
        return sorted({n.task for n in self.nodes})

    def current_task(self) -> int | None:
        """The first task not yet done; None when all are."""
        return next((task for task in self.tasks() if not self.task_done(task)), None)

    def pending(self) -> list[Unit]:
        """Units of the current task that were never started, once no earlier task still runs."""
        task = self.current_task()
        if any(t != task for t, _ in self.running()):
            return []  # a finished task's parameter servers or standbys are being stopped first
        done = self.started.keys() | self.exited.keys() | self.lost
        return [(n.task, n.rank) for n in self.nodes if n.task == task and (n.task, n.rank) not in done]

    def leftovers(self) -> list[Unit]:
        """Units still running for a task that is done (its parameter servers or standbys)."""
        return [(t, r) for t, r in self.running() if self.task_done(t)]

    def node_of(self, unit: Unit) -> NodeLaunch:
        return next(n for n in self.nodes if (n.task, n.rank) == unit)


@dataclass
class LauncherState:
    specs: dict[str, JobSpec] = field(default_factory=dict)
    admissions: dict[str, JobAdmitted] = field(default_factory=dict)
    # Jobs the scheduler wants ended (stop requested, past their duration limit, being moved to a new
    # placement, resuming after a fault, restarting, failed elsewhere, finished).
    ending: set[str] = field(default_factory=set)
    launches: dict[str, Launch] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    # Per job, the attempt the scheduler follows with a new one once it is down (J12 resume, J13 restart).
    renewing: dict[str, int] = field(default_factory=dict)
    # Per job, the attempt and the nodes lost under it: their processes are given up at once (J12).
    lost_nodes: dict[str, tuple[int, set[str]]] = field(default_factory=dict)
    resumes: dict[str, int] = field(default_factory=dict)  # M4: told to the job's next attempt
    settings: AdminSettings = field(default_factory=AdminSettings)  # the cap on graceful shutdowns

    def apply(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if envelope.service == "scheduler":
            self._apply_scheduler_event(event)
            return
        if envelope.service != "launcher":
            return
        self.versions[envelope.aggregate_id] = envelope.version
        if isinstance(event, LaunchPlanned):
            self.launches[event.job_id] = Launch(job_id=event.job_id, attempt=event.attempt,
                                                 nodes=list(event.nodes), version=envelope.version,
                                                 trace=envelope.trace, base_port=event.base_port)
            return
        launch = self.launches.get(envelope.aggregate_id)
        if launch is None or getattr(event, "attempt", None) != launch.attempt:
            return
        if isinstance(event, NodeProcessStarted):
            launch.started[(event.task, event.rank)] = event.pid
        elif isinstance(event, NodeProcessExited):
            launch.exited[(event.task, event.rank)] = event.exit_code
        elif isinstance(event, NodeProcessLost):
            launch.lost.add((event.task, event.rank))
        elif isinstance(event, LaunchSucceeded):
            launch.outcome = "succeeded"
        elif isinstance(event, LaunchFailed):
            launch.outcome = "failed"
        elif isinstance(event, LaunchStopped):
            launch.outcome = "stopped"

    def _apply_scheduler_event(self, event: Event) -> None:
        if isinstance(event, SettingsChanged):
            self.settings = event.settings
            return
        job_id = getattr(event, "job_id", "")
        if isinstance(event, JobSubmitted):
            self.specs[job_id] = event.spec
        elif isinstance(event, JobAdmitted):
            self.admissions[job_id] = event
            self.ending.discard(job_id)
            self.renewing.pop(job_id, None)
            self.lost_nodes.pop(job_id, None)
        elif isinstance(event, JobResuming | JobRestarting):
            self.ending.add(job_id)
            self.renewing[job_id] = event.attempt
            if isinstance(event, JobResuming) and event.lost_nodes:
                self.lost_nodes[job_id] = (event.attempt, set(event.lost_nodes))
        elif isinstance(event, JobRequeued):
            self.resumes[job_id] = event.resumes
        elif isinstance(event, JobFailed | JobStopped | JobSucceeded):
            self.ending.add(job_id)
            self.renewing.pop(job_id, None)  # no next attempt follows
        elif isinstance(event, JobStopRequested | JobExpiring | JobRescaling):
            self.ending.add(job_id)

    def stop_wanted(self, launch: Launch) -> bool:
        return launch.job_id in self.ending or launch.outcome is not None

    def reports_stop(self, launch: Launch) -> bool:
        """Whether the launch is to be recorded LaunchStopped once every node confirmed the stop: the
        scheduler stops it before it had an outcome, or it failed and a new attempt waits for it."""
        if launch.job_id not in self.ending:
            return False
        return launch.outcome is None or (launch.outcome == "failed"
                                          and self.renewing.get(launch.job_id) == launch.attempt)

    def lost_nodes_of(self, launch: Launch) -> set[str]:
        """Nodes of the launch the scheduler found lost: nothing there will answer a stop."""
        attempt, nodes = self.lost_nodes.get(launch.job_id, (0, set()))
        return nodes & {n.node for n in launch.nodes} if attempt == launch.attempt else set()

    def active(self) -> list[Launch]:
        return [launch for launch in self.launches.values()
                if launch.outcome is None or launch.running() or self.reports_stop(launch)]

    def free_ports(self, count: int) -> int:
        """The lowest base port of `count` consecutive ports no active launch holds."""
        used = {port for launch in self.active() for port in launch.ports()}
        base = FIRST_MASTER_PORT
        while any(port in used for port in range(base, base + count)):
            base += 1
        return base
