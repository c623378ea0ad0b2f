"""The scheduler's state: a fold of its own job events and of the monitor's and launcher's events.

Nothing here does I/O. `SchedulerState.apply` takes stored events of any service and updates the
jobs and the node view; the service calls it during rebuild and after every append.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.cluster import ClusterConfig, Flavor, NodeInfo, Resources
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobDurationChanged,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPredicted,
    JobPriorityChanged,
    JobRescaling,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchPlanned,
    NodeLost,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    NodeRecovered,
    NodeRegistered,
    Placement,
    SettingsChanged,
)
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec, Priority, parse_duration
from libs.contracts.messages import TERMINAL_STATUSES, InstanceView, JobStatus, JobView
from libs.contracts.scheduling import AdminSettings, Prediction
from services.scheduler.placement import holdings as placement_holdings


@dataclass
class Instance:
    """One node of a running job, as the launcher reports it."""

    rank: int
    node: str
    pid: int | None = None
    exit_code: int | None = None
    lost: bool = False
    role: str = "worker"

    @property
    def state(self) -> str:
        if self.lost:
            return "lost"
        if self.exit_code is not None:
            return "exited"
        return "running" if self.pid is not None else "pending"


@dataclass
class Job:
    job_id: str
    spec: JobSpec
    creator: str
    submitted_at: datetime
    queue_order: int
    version: int = 0
    status: JobStatus = "queued"
    attempt: int = 0
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    reason: str | None = None
    exit_code: int | None = None
    stop_requested_by: str | None = None
    deleted: bool = False
    instances: dict[int, Instance] = field(default_factory=dict)
    trace: dict[str, str] = field(default_factory=dict)
    priority: Priority = "normal"  # S3: the spec's, until changed
    duration: str | None = None  # S11: the spec's limit, until changed
    dropped_flavors: list[str] = field(default_factory=list)
    expiring: bool = False  # J16: past its limit, being stopped
    rescaling: JobRescaling | None = None  # S10: being moved to a new placement
    prediction: Prediction | None = None
    cloned_from: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def duration_seconds(self) -> int | None:
        return parse_duration(self.duration) if self.duration else None

    @property
    def ends_at(self) -> datetime | None:
        """When a running job passes its duration limit (J16); None without a limit."""
        seconds = self.duration_seconds
        if self.started_at is None or seconds is None:
            return None
        return self.started_at + timedelta(seconds=seconds)

    def sort_key(self) -> tuple[int, int]:
        """S1: very urgent before urgent before normal; first come first served within a level."""
        return (PRIORITY_RANK[self.priority], self.queue_order)


@dataclass
class NodeState:
    info: NodeInfo
    lost: bool = False


@dataclass
class SchedulerState:
    cluster: ClusterConfig
    jobs: dict[str, Job] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    settings: AdminSettings = field(default_factory=AdminSettings)
    settings_version: int = 0

    # --- folding events --------------------------------------------------------------------------

    def apply(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        at = envelope.recorded_at
        if isinstance(event, NodeRegistered):
            self.nodes[event.node.name] = NodeState(info=event.node)
            return
        if isinstance(event, NodeLost):
            if event.node_name in self.nodes:
                self.nodes[event.node_name].lost = True
            return
        if isinstance(event, NodeRecovered):
            if event.node_name in self.nodes:
                self.nodes[event.node_name].lost = False
            return
        if isinstance(event, SettingsChanged):
            self.settings, self.settings_version = event.settings, envelope.version
            return
        if isinstance(event, JobSubmitted):
            self.jobs[event.job_id] = Job(job_id=event.job_id, spec=event.spec, creator=event.creator,
                                          submitted_at=at, queue_order=envelope.position,
                                          trace=envelope.trace, priority=event.spec.priority,
                                          duration=event.spec.duration, cloned_from=event.cloned_from)
        job = self.jobs.get(getattr(event, "job_id", ""))
        if job is None:
            return
        if envelope.service == "scheduler":
            job.version = envelope.version
            self._apply_job_event(job, envelope)
        else:
            self._apply_launch_event(job, envelope)

    def _apply_job_event(self, job: Job, envelope: EventEnvelope) -> None:
        event = envelope.event
        at = envelope.recorded_at
        if isinstance(event, JobAdmitted):
            job.status = "running"
            job.attempt = event.attempt
            job.flavor = event.flavor
            job.placement = list(event.placement)
            job.dropped_flavors = list(event.dropped_flavors)
            if job.rescaling is None:
                job.started_at = at  # a rescaled job keeps its start, so its duration limit still counts
            job.rescaling = None
            job.instances = {p.rank: Instance(rank=p.rank, node=p.node, role=p.role) for p in event.placement}
        elif isinstance(event, JobPredicted):
            job.prediction = event.prediction
        elif isinstance(event, JobPriorityChanged):
            job.priority = event.priority
        elif isinstance(event, JobDurationChanged):
            job.duration = event.duration
        elif isinstance(event, JobExpiring):
            job.expiring = True
        elif isinstance(event, JobExpired):
            job.status, job.ended_at, job.reason = "expired", at, event.reason
            job.expiring, job.rescaling = False, None
        elif isinstance(event, JobRescaling):
            job.rescaling = event
        elif isinstance(event, JobStopRequested):
            job.stop_requested_by = event.by
        elif isinstance(event, JobSucceeded):
            job.status, job.ended_at, job.exit_code = "succeeded", at, 0
        elif isinstance(event, JobFailed):
            job.status, job.ended_at = "failed", at
            job.reason, job.exit_code = event.reason, event.exit_code
            job.rescaling = None
        elif isinstance(event, JobStopped):
            job.status, job.ended_at, job.reason = "stopped", at, event.reason
            job.rescaling = None
        elif isinstance(event, JobDeleted):
            job.deleted = True

    def _apply_launch_event(self, job: Job, envelope: EventEnvelope) -> None:
        event = envelope.event
        if getattr(event, "attempt", None) != job.attempt:
            return
        if isinstance(event, LaunchPlanned):
            for launch in event.nodes:
                job.instances.setdefault(launch.rank, Instance(rank=launch.rank, node=launch.node)).role = launch.role
        elif isinstance(event, NodeProcessStarted):
            # A batch job's ranks start once per task: the instance shows the task running now.
            instance = job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node))
            instance.pid, instance.exit_code = event.pid, None
        elif isinstance(event, NodeProcessExited):
            instance = job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node))
            instance.exit_code = event.exit_code
        elif isinstance(event, NodeProcessLost):
            job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node)).lost = True

    # --- queries ---------------------------------------------------------------------------------

    def flavor(self, name: str) -> Flavor | None:
        return self.cluster.flavor(name)

    def queue(self) -> list[Job]:
        """Queued jobs in start order (S1)."""
        return sorted((j for j in self.jobs.values() if j.status == "queued"), key=Job.sort_key)

    def running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.status == "running"]

    def holdings(self, job: Job) -> dict[str, Resources]:
        """What a running job holds per node: its placement and, while it is being moved (S10), the
        placement it moves to, so that nothing else takes those resources meanwhile."""
        held: dict[str, Resources] = {}
        for flavor_name, placement in ((job.flavor, job.placement),
                                       *([(job.rescaling.flavor, job.rescaling.placement)] if job.rescaling else [])):
            flavor = self.flavor(flavor_name or "")
            if flavor is None:
                continue
            for node, amount in placement_holdings(placement, flavor).items():
                held[node] = held.get(node, Resources()) + amount
        return held

    def used(self) -> dict[str, Resources]:
        """Resources held per node by running jobs."""
        used: dict[str, Resources] = {name: Resources() for name in self.nodes}
        for job in self.running():
            for node, held in self.holdings(job).items():
                used[node] = used.get(node, Resources()) + held
        return used

    def queue_positions(self) -> dict[str, int]:
        return {job.job_id: index for index, job in enumerate(self.queue(), start=1)}

    def jobs_on(self, node: str) -> list[Job]:
        return [j for j in self.running() if any(p.node == node for p in j.placement)]

    def view(self, job: Job, positions: dict[str, int] | None = None) -> JobView:
        queue_position = None
        if job.status == "queued":
            queue_position = (positions if positions is not None else self.queue_positions()).get(job.job_id)
        spec = job.spec
        return JobView(
            job_id=job.job_id, name=spec.name, project=spec.project, creator=job.creator,
            status=job.status, priority=job.priority, mode=spec.mode, nodes=spec.nodes,
            flavors=list(spec.flavors), submitted_at=job.submitted_at, flavor=job.flavor,
            attempt=job.attempt, started_at=job.started_at, ended_at=job.ended_at, reason=job.reason,
            exit_code=job.exit_code, output=spec.output.name if spec.output else None,
            queue_position=queue_position, placement=list(job.placement),
            duration=job.duration, expires_at=job.ends_at if job.status == "running" else None,
            dropped_flavors=list(job.dropped_flavors),
            access=spec.access if self.settings.sharing_enabled else "none",
            cloned_from=job.cloned_from, prediction=job.prediction,
            instances=[
                InstanceView(rank=i.rank, node=i.node, master=i.rank == 0, state=i.state,  # type: ignore[arg-type]
                             pid=i.pid, exit_code=i.exit_code, role=i.role)
                for i in sorted(job.instances.values(), key=lambda i: i.rank)
            ],
        )
