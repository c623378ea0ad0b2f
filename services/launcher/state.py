"""The launcher's state: its launches (own events) and what it needs from the scheduler's events."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobExpiring,
    JobFailed,
    JobRescaling,
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
)
from libs.contracts.jobspec import JobSpec

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
    # placement, failed elsewhere, finished).
    ending: set[str] = field(default_factory=set)
    launches: dict[str, Launch] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def apply(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if envelope.service == "scheduler":
            if isinstance(event, JobSubmitted):
                self.specs[event.job_id] = event.spec
            elif isinstance(event, JobAdmitted):
                self.admissions[event.job_id] = event
                self.ending.discard(event.job_id)
            elif isinstance(event, JobStopRequested | JobExpiring | JobRescaling | JobFailed | JobStopped
                            | JobSucceeded):
                self.ending.add(event.job_id)
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

    def stop_wanted(self, launch: Launch) -> bool:
        return launch.job_id in self.ending or launch.outcome is not None

    def active(self) -> list[Launch]:
        return [launch for launch in self.launches.values() if launch.outcome is None or launch.running()]

    def free_ports(self, count: int) -> int:
        """The lowest base port of `count` consecutive ports no active launch holds."""
        used = {port for launch in self.active() for port in launch.ports()}
        base = FIRST_MASTER_PORT
        while any(port in used for port in range(base, base + count)):
            base += 1
        return base
