"""The launcher's state: its launches (own events), the jobs' lifecycle, and what only it needs to know.

What state a job is in (its spec, resumes, the administrator's settings) is the shared fold of the
scheduler's events (libs.jobstatus). Beside it the launcher keeps what is its own, keyed by the
scheduler's aggregate id: which jobs it must end, which failed attempt a new one follows, and the
nodes lost under an attempt.

An attempt the scheduler stops is reported LaunchStopped once it is down. So is a failed attempt the
scheduler follows with a new one (a fault restart, J13; a resume, J12): the next attempt may only
start once the scheduler knows nothing of this one still runs.

A job the scheduler archives (JobArchived: it ended longer ago than the administrator's retention) leaves the state
whole, so that memory stays flat however many jobs pass through: at once, or once its launch has settled and what
was given up on its nodes is known stopped, when it has not yet (the launcher was away longer than the retention,
or a node does not answer). Nothing of it is recorded afterwards, and what keeps anything beside the state is told
(`on_leave`).

A snapshot holds the state as it stands (`saved`, `loaded`; libs.skeleton.snapshots): each launch by what it was
made from (its plan) and what happened to it since, in the order it happened, so that what is worked out of them
(the units per task, the workers done) is worked out again as the folds did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobExpiring,
    JobFailed,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSucceeded,
    LaunchFailed,
    LaunchPlanned,
    LaunchShape,
    LaunchStopped,
    LaunchSucceeded,
    LostProcessesStopped,
    NodeLaunch,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    Role,
)
from libs.contracts.images import ImageUse
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import AdminSettings
from libs.jobstatus import JobLifecycle, JobRecord
from libs.skeleton.snapshots import SavedLifecycle, load_lifecycle, save_lifecycle
from services.launcher.planner import NodeLaunches, Unit

# Where the launcher's own choice of rendezvous ports starts, for a node that did not choose them (an agent
# older than ReservePorts, or one that stays silent).
FIRST_FALLBACK_PORT = 29500


@dataclass
class Launch:
    """One attempt of one job across its nodes (and, for a batch job, its tasks one after another).

    Where each unit runs and which units are workers is indexed when the launch is made, and what each task's
    workers finished counted as they exit, so that each report and each look at a launch of 1,024 nodes costs
    the same as at one node; a unit's whole launch is derived only to start it (`plan`)."""

    job_id: str
    attempt: int
    plan: NodeLaunches
    started: dict[Unit, int] = field(default_factory=dict)  # -> pid
    exited: dict[Unit, int] = field(default_factory=dict)  # -> exit code
    lost: set[Unit] = field(default_factory=set)  # on nodes that stopped answering
    outcome: str | None = None  # succeeded | failed | stopped
    trace: dict[str, str] = field(default_factory=dict)  # the job's trace, continued by every call
    ports: dict[int, int] = field(default_factory=dict)  # rank -> its rendezvous port
    planned_at: datetime = field(default_factory=lambda: datetime.now(UTC))  # issue time of the job's token

    def __post_init__(self) -> None:
        self.by_task: dict[int, list[Unit]] = {}
        self._workers: Counter[int] = Counter()  # per task: its workers
        for unit in self.plan.units:
            self.by_task.setdefault(unit[0], []).append(unit)
            if self.role(unit) == "worker":
                self._workers[unit[0]] += 1
        self._workers_done: Counter[int] = Counter()  # per task: its workers that exited 0
        self.node_names: list[str] = list(dict.fromkeys(node for node, _ in self.plan.placed.values()))

    def node(self, unit: Unit) -> str:
        return self.plan.placed[unit][0]

    def role(self, unit: Unit) -> Role:
        return self.plan.placed[unit][1]

    def exit(self, unit: Unit, exit_code: int) -> None:
        """Record the exit of `unit` (once: later reports of it change nothing)."""
        if unit in self.exited:
            return
        self.exited[unit] = exit_code
        if exit_code == 0 and self.role(unit) == "worker":
            self._workers_done[unit[0]] += 1

    def running(self) -> list[Unit]:
        return [unit for unit in self.started if unit not in self.exited and unit not in self.lost]

    def task_done(self, task: int) -> bool:
        """Every worker of the task exited 0 (parameter servers are stopped afterwards)."""
        return self._workers_done[task] == self._workers[task]

    def finished_with(self, unit: Unit, exit_code: int) -> bool:
        """Whether every worker of every task has exited 0 once `unit` exits with `exit_code`."""
        left = sum(self._workers.values()) - sum(self._workers_done.values())
        if unit not in self.exited and exit_code == 0 and self.role(unit) == "worker":
            left -= 1
        return left == 0 and (exit_code == 0 or self.role(unit) != "worker")

    def tasks(self) -> list[int]:
        return sorted(self.by_task)

    def current_task(self) -> int | None:
        """The first task not yet done; None when all are."""
        return next((task for task in self.tasks() if not self.task_done(task)), None)

    def pending(self) -> list[Unit]:
        """Units of the current task that were never started, once no earlier task still runs."""
        task = self.current_task()
        if any(t != task for t, _ in self.running()):
            return []  # a finished task's parameter servers or standbys are being stopped first
        done = self.started.keys() | self.exited.keys() | self.lost
        return [unit for unit in self.by_task.get(task, []) if unit not in done] if task is not None else []

    def leftovers(self) -> list[Unit]:
        """Units still running for a task that is done (its parameter servers or standbys)."""
        return [(t, r) for t, r in self.running() if self.task_done(t)]


@dataclass(frozen=True)
class Admitted:
    """An attempt the scheduler admitted, and the job's trace its plan continues."""

    event: JobAdmitted
    trace: dict[str, str]


# The scheduler's events after which the launcher ends a job's current attempt: a stop requested, past
# its duration limit, moved to a new placement, resuming after a fault, restarting, failed elsewhere,
# finished.
_ENDS_ATTEMPT = (JobStopRequested, JobExpiring, JobRescaling, JobResuming, JobRestarting, JobFailed, JobStopped,
                 JobSucceeded)


def _kept_nowhere(job_id: str) -> None:
    """What a state alone does when a job leaves it: nothing is kept beside it."""


@dataclass
class LauncherState:
    lifecycle: JobLifecycle = field(default_factory=JobLifecycle)
    launches: dict[str, Launch] = field(default_factory=dict)
    # Jobs whose current attempt the launcher must end (see _ENDS_ATTEMPT), until their next admission.
    ending: set[str] = field(default_factory=set)
    # Per job, the attempt the scheduler follows with a new one once it is down (J12 resume, J13 restart).
    renewing: dict[str, int] = field(default_factory=dict)
    # Per job, the attempt and the nodes lost under it: their processes are given up at once (J12).
    lost_nodes: dict[str, tuple[int, set[str]]] = field(default_factory=dict)
    # (job, attempt, node) whose processes were given up (NodeProcessLost) and not yet seen stopped: the
    # node is asked to stop them until it answers, whenever it comes back (LostProcessesStopped).
    fences: set[tuple[str, int, str]] = field(default_factory=set)
    # Per job, the newest attempt the launcher planned (or failed to plan), and the admission of a newer one
    # it has yet to plan: its nodes are asked for rendezvous ports first (see dispatcher.py).
    planned: dict[str, int] = field(default_factory=dict)
    unplanned: dict[str, Admitted] = field(default_factory=dict)
    # The jobs whose launch may still need the dispatcher (`active`): a launch that ended for good leaves it,
    # so that every pass looks at the launches under way, however many ended before.
    unsettled: dict[str, None] = field(default_factory=dict)
    # The jobs whose launch or lifecycle changed since the dispatcher last took them (`take_touched`): what a
    # pass needs to look at between the passes over every launch under way.
    touched: set[str] = field(default_factory=set)
    # Jobs archived whose launch is still under way, or whose given-up processes are not known stopped yet: they
    # leave the state once that has settled.
    archived: set[str] = field(default_factory=set)
    # Told the id of every job that left the state, so that what is kept of it beside the state goes too.
    on_leave: Callable[[str], None] = field(default=_kept_nowhere, compare=False, repr=False)

    # --- folds ----------------------------------------------------------------------------------------

    def apply(self, envelope: EventEnvelope) -> None:
        """Fold one of the launcher's own events."""
        event = envelope.event
        self.touched.add(envelope.aggregate_id)
        if isinstance(event, LaunchPlanned):
            self.launches[envelope.aggregate_id] = Launch(job_id=event.job_id, attempt=event.attempt,
                                                          plan=NodeLaunches.of(event), trace=envelope.trace,
                                                          ports=event.rank_ports(), planned_at=envelope.recorded_at)
            self.unsettled[envelope.aggregate_id] = None
        if isinstance(event, LaunchPlanned | LaunchFailed):
            self._planned(envelope.aggregate_id, event.attempt)
            if isinstance(event, LaunchPlanned):
                return
        if isinstance(event, NodeProcessLost):  # kept apart from the launch: a next attempt replaces it
            self.fences.add((event.job_id, event.attempt, event.node))
        elif isinstance(event, LostProcessesStopped):
            self.fences.discard((event.job_id, event.attempt, event.node))
            if event.job_id in self.archived:
                self._leave_once_settled(event.job_id)
            return
        launch = self.launches.get(envelope.aggregate_id)
        if launch is None or getattr(event, "attempt", None) != launch.attempt:
            return
        if isinstance(event, NodeProcessStarted):
            launch.started[(event.task, event.rank)] = event.pid
            # A start reported after the launch had its outcome (a parameter server whose workers ended at
            # once, their starts reported with their exits) is a process to stop: the launch is under way again.
            self.unsettled[envelope.aggregate_id] = None
        elif isinstance(event, NodeProcessExited):
            launch.exit((event.task, event.rank), event.exit_code)
        elif isinstance(event, NodeProcessLost):
            launch.lost.add((event.task, event.rank))
        elif isinstance(event, LaunchSucceeded):
            launch.outcome = "succeeded"
        elif isinstance(event, LaunchFailed):
            launch.outcome = "failed"
        elif isinstance(event, LaunchStopped):
            launch.outcome = "stopped"

    def apply_scheduler(self, envelope: EventEnvelope) -> None:
        """Fold one of the scheduler's events: the job's lifecycle, then what the launcher must do."""
        job = self.lifecycle.apply(envelope)
        if envelope.aggregate_type != "job" or job is None:
            return  # settings, or a job the state does not hold (archived before: a delete of it, say)
        job_id, event = envelope.aggregate_id, envelope.event
        if job.archived:
            self._archive(job)
            return
        self.touched.add(job_id)
        if isinstance(event, JobAdmitted):
            if event.attempt > self.planned.get(job_id, 0):
                self.unplanned[job_id] = Admitted(event, envelope.trace)
            self.ending.discard(job_id)
            self.renewing.pop(job_id, None)
            self.lost_nodes.pop(job_id, None)
            return
        if isinstance(event, _ENDS_ATTEMPT):
            self.ending.add(job_id)
        if isinstance(event, JobResuming | JobRestarting):
            self.renewing[job_id] = event.attempt
            if isinstance(event, JobResuming) and event.lost_nodes:
                self.lost_nodes[job_id] = (event.attempt, set(event.lost_nodes))
        elif isinstance(event, JobFailed | JobStopped | JobSucceeded):
            self.renewing.pop(job_id, None)  # no next attempt follows

    # --- what the scheduler told ----------------------------------------------------------------------

    def spec(self, job_id: str) -> JobSpec | None:
        job = self.lifecycle.jobs.get(job_id)
        return job.spec if job is not None else None

    def creator(self, job_id: str) -> str:
        """Who submitted the job (empty when unknown)."""
        job = self.lifecycle.jobs.get(job_id)
        return job.creator if job is not None else ""

    def image(self, job_id: str) -> ImageUse | None:
        """J10: the image the job runs in (None: on its nodes' own files)."""
        job = self.lifecycle.jobs.get(job_id)
        return job.image if job is not None else None

    def resumes(self, job_id: str) -> int:
        """M4: how often the job resumed so far, told to its next attempt."""
        job = self.lifecycle.jobs.get(job_id)
        return job.resumes if job is not None else 0

    @property
    def settings(self) -> AdminSettings:
        """The administrator's settings: the cap on graceful shutdowns."""
        return self.lifecycle.settings

    # --- launches -------------------------------------------------------------------------------------

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
        return nodes & set(launch.node_names) if attempt == launch.attempt else set()

    def take_touched(self) -> set[str]:
        """The jobs touched since the last time they were taken."""
        touched, self.touched = self.touched, set()
        return touched

    def holds(self, job_id: str) -> bool:
        """Whether the job has a launch or an attempt to plan here (not before its admission, nor once it left)."""
        return job_id in self.launches or job_id in self.unplanned

    def active(self, among: Iterable[str] | None = None) -> list[Launch]:
        """The launches under way: all of them, or those of the jobs `among`."""
        found = []
        for job_id in list(self.unsettled) if among is None else [j for j in among if j in self.unsettled]:
            launch = self.launches[job_id]
            if self._under_way(launch):
                found.append(launch)
            elif self._settled(launch):
                del self.unsettled[job_id]
                if job_id in self.archived:
                    self._leave_once_settled(job_id)
        return found

    def _under_way(self, launch: Launch) -> bool:
        return launch.outcome is None or bool(launch.running()) or self.reports_stop(launch)

    def _settled(self, launch: Launch) -> bool:
        """Ended for good: only a new attempt (a launch of its own) needs the dispatcher again. A failed
        launch may still be stopped for a restart or a resume, until its job ended."""
        if launch.outcome in ("succeeded", "stopped"):
            return True
        job = self.lifecycle.jobs.get(launch.job_id)
        return job is None or job.ended

    # --- archived jobs ------------------------------------------------------------------------------

    def _archive(self, job: JobRecord) -> None:
        """The job ended long ago: nothing of it is planned now, and it leaves once its launch has settled."""
        self.unplanned.pop(job.job_id, None)
        self.archived.add(job.job_id)
        self._leave_once_settled(job.job_id)

    def _leave_once_settled(self, job_id: str) -> None:
        """An archived job leaves unless its launch is still under way (its processes are stopped first) or a node
        has yet to stop what was given up there (asked until it answers)."""
        launch = self.launches.get(job_id)
        if launch is not None and job_id in self.unsettled and self._under_way(launch):
            return
        if any(fenced_job == job_id for fenced_job, _, _ in self.fences):
            return
        self._leave(job_id)

    def _leave(self, job_id: str) -> None:
        self.archived.discard(job_id)
        self.launches.pop(job_id, None)
        self.unsettled.pop(job_id, None)
        self.ending.discard(job_id)
        self.renewing.pop(job_id, None)
        self.lost_nodes.pop(job_id, None)
        self.planned.pop(job_id, None)
        self.unplanned.pop(job_id, None)
        self.touched.discard(job_id)
        self.on_leave(job_id)

    def _planned(self, job_id: str, attempt: int) -> None:
        self.planned[job_id] = max(attempt, self.planned.get(job_id, 0))
        admission = self.unplanned.get(job_id)
        if admission is not None and admission.event.attempt <= attempt:
            del self.unplanned[job_id]

    # --- snapshots --------------------------------------------------------------------------------------

    def saved(self) -> bytes:
        """The state as a snapshot holds it (sets in one order, so that equal states save the same bytes)."""
        return _ENCODER.encode(SavedLauncherState(
            lifecycle=save_lifecycle(self.lifecycle), launches=[_saved(launch) for launch in self.launches.values()],
            ending=sorted(self.ending), renewing=self.renewing,
            lost_nodes={job_id: (attempt, sorted(nodes)) for job_id, (attempt, nodes) in self.lost_nodes.items()},
            fences=sorted(self.fences), planned=self.planned,
            unplanned={job_id: _SavedAdmission(admitted.event, admitted.trace)
                       for job_id, admitted in self.unplanned.items()},
            unsettled=list(self.unsettled), touched=sorted(self.touched), archived=sorted(self.archived)))

    @classmethod
    def loaded(cls, data: bytes, on_leave: Callable[[str], None] = _kept_nowhere) -> LauncherState:
        """The state `saved` wrote."""
        return cls.restored(decoded(data), on_leave)

    @classmethod
    def restored(cls, saved: SavedLauncherState, on_leave: Callable[[str], None] = _kept_nowhere) -> LauncherState:
        """The state `saved` holds; each launch's saved form goes as soon as the launch is made of it, so that a start
        holds the two at once for one launch, not for all."""
        launches: dict[str, Launch] = {}
        saved.launches.reverse()
        while saved.launches:
            launch = _loaded(saved.launches.pop())
            launches[launch.job_id] = launch
        return cls(lifecycle=load_lifecycle(saved.lifecycle), launches=launches,
                   ending=set(saved.ending), renewing=saved.renewing,
                   lost_nodes={job_id: (attempt, set(nodes)) for job_id, (attempt, nodes) in saved.lost_nodes.items()},
                   fences=set(saved.fences), planned=saved.planned,
                   unplanned={job_id: Admitted(admitted.event, admitted.trace)
                              for job_id, admitted in saved.unplanned.items()},
                   unsettled=dict.fromkeys(saved.unsettled), touched=set(saved.touched), archived=set(saved.archived),
                   on_leave=on_leave)

    def fallback_ports(self, count: int) -> list[int]:
        """The launcher's own choice for a node that chose no ports: the lowest ones no active launch holds
        on any node."""
        if count == 0:
            return []
        used = {port for launch in self.active() for port in launch.ports.values()}
        chosen: list[int] = []
        port = FIRST_FALLBACK_PORT
        while len(chosen) < count:
            if port not in used:
                chosen.append(port)
            port += 1
        return chosen


class _SavedLaunch(msgspec.Struct, array_like=True):
    """A launch as a snapshot holds it: its plan as recorded, and what happened to it since, in that order."""

    job_id: str
    attempt: int
    mode: str
    shape: LaunchShape | None
    recorded: list[NodeLaunch]  # a plan recorded before shapes: every node's launch
    started: list[tuple[int, int, int]]  # (task, rank, pid)
    exited: list[tuple[int, int, int]]  # (task, rank, exit code), in the order they exited
    lost: list[tuple[int, int]]
    outcome: str | None
    trace: dict[str, str]
    ports: dict[int, int]
    planned_at: datetime


class _SavedAdmission(msgspec.Struct, array_like=True):
    event: JobAdmitted
    trace: dict[str, str]


class SavedLauncherState(msgspec.Struct, array_like=True):
    lifecycle: SavedLifecycle
    launches: list[_SavedLaunch]
    ending: list[str]
    renewing: dict[str, int]
    lost_nodes: dict[str, tuple[int, list[str]]]
    fences: list[tuple[str, int, str]]
    planned: dict[str, int]
    unplanned: dict[str, _SavedAdmission]
    unsettled: list[str]
    touched: list[str]
    archived: list[str]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SavedLauncherState)


def decoded(data: bytes) -> SavedLauncherState:
    """What `LauncherState.saved` wrote, read back (to be made a state by `LauncherState.restored`)."""
    return _DECODER.decode(data)


def _saved(launch: Launch) -> _SavedLaunch:
    plan = launch.plan
    return _SavedLaunch(job_id=launch.job_id, attempt=launch.attempt, mode=plan.mode, shape=plan.shape,
                        recorded=plan.every() if plan.shape is None else [],
                        started=[(task, rank, pid) for (task, rank), pid in launch.started.items()],
                        exited=[(task, rank, code) for (task, rank), code in launch.exited.items()],
                        lost=sorted(launch.lost), outcome=launch.outcome, trace=launch.trace, ports=launch.ports,
                        planned_at=launch.planned_at)


def _loaded(saved: _SavedLaunch) -> Launch:
    launch = Launch(job_id=saved.job_id, attempt=saved.attempt,
                    plan=NodeLaunches(saved.mode, saved.shape, saved.recorded),
                    started={(task, rank): pid for task, rank, pid in saved.started},
                    lost={(task, rank) for task, rank in saved.lost}, outcome=saved.outcome, trace=saved.trace,
                    ports=saved.ports, planned_at=saved.planned_at)
    for task, rank, code in saved.exited:
        launch.exit((task, rank), code)
    return launch
