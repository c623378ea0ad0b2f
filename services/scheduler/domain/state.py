"""The scheduler's state: a fold of its own job events and of the monitor's and launcher's events.

Nothing here does I/O. `SchedulerState.apply` takes stored events of any service and updates the
jobs and the node view; the service calls it during rebuild and after every append.

A checkpoint-resume job (J12) is placed, then pre-checked (M1): while the monitor checks its nodes it
stays `queued` but leaves the queue and holds the placement. A fault moves it (JobResuming) and,
once its attempt is down, puts it back in the queue (JobRequeued) at its old place. A fault-restart
job (J13) whose command failed is restarted (JobRestarting) on the same nodes.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Generic, Protocol, TypeVar

from libs.contracts.arrays import ArrayMember
from libs.contracts.cluster import ClusterConfig, Flavor, Resources
from libs.contracts.events import (
    ArraySubmitted,
    DatasetCached,
    DatasetEvicted,
    DatasetPreloadRequested,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    EventEnvelope,
    ImageDeleted,
    ImageMarked,
    ImageRegistered,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobDurationChanged,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobPredicted,
    JobPriorityChanged,
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
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    Placement,
    ProvisionFailed,
    SettingsChanged,
    StorageAccessSet,
)
from libs.contracts.images import ImageRecord, ImageUse
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec, Priority, parse_duration
from libs.contracts.operations.base import TERMINAL_STATUSES, JobStatus
from libs.contracts.operations.jobs import InstanceView, JobView
from libs.contracts.scheduling import AdminSettings, Prediction, StoredAccess
from libs.nodes import NodeState, fold_node_event
from libs.placement import NO_NODES, NodeCapacity, QueuedJob, RunningJob
from libs.placement import holdings as placement_holdings
from libs.storage import staged_sources
from services.scheduler.domain.images import fold_image
from services.scheduler.domain.names import ABOUT_JOBS, ARRAY, JOB, SERVICE


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


@dataclass(slots=True)
class Job:
    """A job as the scheduler knows it. Changed only by `SchedulerState.apply`, which keeps what is derived
    from it (the queue, what it holds, how the decision logic sees it) up to date."""

    job_id: str
    spec: JobSpec
    creator: str
    submitted_at: datetime
    queue_order: int
    status: JobStatus = "queued"
    attempt: int = 0
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    # The latest exit of a rank of the current attempt, by the agent's clock: when the job really ended,
    # however late the report was recorded (the launcher or NATS away meanwhile).
    last_exit_at: datetime | None = None
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
    image: ImageUse | None = None  # J10: the image it runs in, as accepted
    precheck: JobPrechecking | None = None  # M1: placed, its nodes held while the monitor checks them
    resuming: JobResuming | None = None  # J12: its attempt is being stopped to resume elsewhere
    restarting: JobRestarting | None = None  # J13: its failed attempt is being stopped to restart
    resumes: int = 0
    restarts: int = 0
    excluded_nodes: list[str] = field(default_factory=list)  # never placed there again (M6 reschedule)
    failed_precheck: tuple[datetime, list[str]] | None = None  # when its last pre-check failed, and where
    kept_until: datetime | None = None  # J15: its environments are kept for the debug terminal
    running_since: datetime | None = None  # J16: since when its running time counts (None: queued)
    ran_before: timedelta = timedelta()  # J16: what it ran before it went back to the queue
    # J14: per attempt, how long its nodes' data preparation took (the longest node): not counted by J16.
    staging_seconds: dict[int, float] = field(default_factory=dict)
    # J12: a checkpoint-resume job's failed attempt, and when it failed: a node fault reported soon
    # after explains it (the job resumes); otherwise it fails once the fault would have been seen.
    unexplained_failure: tuple[LaunchFailed, datetime] | None = None
    # How the decision logic last saw it while queued (decision_inputs.py): made again only when what it is made
    # from changed, so that a cycle over a deep queue does not build every job anew.
    queued_as: QueuedJob | None = field(default=None, compare=False, repr=False)
    # Likewise while it holds resources (unless it is pre-checked with a limit: then it ends as if started now).
    running_as: RunningJob | None = field(default=None, compare=False, repr=False)
    rank: int = field(default=0, compare=False, repr=False)  # PRIORITY_RANK of its priority
    array: ArrayMember | None = None  # the array it belongs to, and its index there
    # The stream sequences of the other services' events about it (its launches', the monitor's), in order: where
    # its history is read back from (`history/archived.py`), written beside the log when it is archived.
    published: list[int] = field(default_factory=list, compare=False, repr=False)
    # `duration` parsed, and the text it was parsed from; `ends_at` once worked out, until the job's next event:
    # both are read on every cycle.
    _parsed: tuple[str | None, int | None] = field(default=(None, None), init=False, compare=False, repr=False)
    _ends: tuple[datetime | None] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.rank = PRIORITY_RANK[self.priority]

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def prechecking(self) -> bool:
        return self.status == "queued" and self.precheck is not None

    @property
    def moving(self) -> bool:
        """Its attempt is already being stopped, for whatever reason."""
        return (self.resuming is not None or self.restarting is not None or self.rescaling is not None
                or self.expiring or self.stop_requested_by is not None)

    @property
    def duration_seconds(self) -> int | None:
        duration = self.duration
        if duration != self._parsed[0]:
            self._parsed = (duration, parse_duration(duration) if duration else None)
        return self._parsed[1]

    @property
    def ends_at(self) -> datetime | None:
        """When a running job passes its duration limit (J16); None without a limit. The limit counts
        from its first start; time spent back in the queue after a move (J12), and in data preparation (J14),
        does not count."""
        if self._ends is None:
            seconds = self.duration_seconds
            if self.running_since is None or seconds is None:
                self._ends = (None,)
            else:
                staging = timedelta(seconds=sum(self.staging_seconds.values()))
                self._ends = (self.running_since + timedelta(seconds=seconds) - self.ran_before + staging,)
        return self._ends[0]

    def changed(self) -> None:
        """Forget what was worked out from it: one of its events was folded."""
        self.queued_as = self.running_as = self._ends = None

    def sort_key(self) -> tuple[int, int]:
        """S1: very urgent before urgent before normal; first come first served within a level."""
        return (PRIORITY_RANK[self.priority], self.queue_order)


class _Identified(Protocol):
    @property
    def job_id(self) -> str: ...


Kept = TypeVar("Kept", bound=_Identified)


class _Ordered(Generic[Kept]):
    """Jobs kept in the order of a key, as they come and go, so that reading them in order sorts nothing. A job
    leaves by the key it came with, whatever changed in it since."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, str]] = []
        self.jobs: list[Kept] = []
        self.key_of: dict[str, tuple[int, int, str]] = {}

    def put(self, job: Kept, key: tuple[int, int, str]) -> None:
        """Keep `job` at `key`."""
        if self.key_of.get(job.job_id) == key and self.jobs[bisect.bisect_left(self.keys, key)] is job:
            return
        self.discard(job.job_id)
        index = bisect.bisect_left(self.keys, key)
        self.keys.insert(index, key)
        self.jobs.insert(index, job)
        self.key_of[job.job_id] = key

    def discard(self, job_id: str) -> None:
        key = self.key_of.pop(job_id, None)
        if key is not None:
            index = bisect.bisect_left(self.keys, key)
            del self.keys[index], self.jobs[index]

    def index(self, job_id: str) -> int | None:
        key = self.key_of.get(job_id)
        return None if key is None else bisect.bisect_left(self.keys, key)

    def get(self, job_id: str) -> Kept | None:
        index = self.index(job_id)
        return None if index is None else self.jobs[index]

    def clear(self) -> None:
        self.keys.clear()
        self.jobs.clear()
        self.key_of.clear()


class GivenRunning:
    """What the decision logic was last given of the jobs holding resources (decision_inputs.running_jobs_changed):
    each as a `RunningJob`, in submission order; the list it was handed; the jobs changed since (None: any may have);
    those made again every time (they depend on the time). Left out of a snapshot: a state read back makes it again."""

    def __init__(self) -> None:
        self.made: _Ordered[RunningJob] = _Ordered()
        self.listed: list[RunningJob] | None = None
        self.changed: set[str] | None = None
        self.every_time: set[str] = set()

    def touch(self, job_id: str) -> None:
        if self.changed is not None:
            self.changed.add(job_id)

    def __reduce__(self) -> tuple[type[GivenRunning], tuple[()]]:
        return GivenRunning, ()  # read back (or copied) empty


def _microseconds(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000)


def _ended_at(job: Job, recorded: datetime) -> datetime:
    """When a job that ended with its processes' exits ended: its last rank's exit, by the agent's clock, when
    known (never later than the record of the end, whatever the clocks say)."""
    if job.last_exit_at is None:
        return recorded
    ended = min(job.last_exit_at, recorded)
    return max(ended, job.started_at) if job.started_at is not None else ended


@dataclass
class Array:
    """A job array as one object: what it was submitted as, and its jobs by index."""

    submitted: ArraySubmitted
    submitted_at: datetime
    jobs: dict[int, str] = field(default_factory=dict)  # index -> job id, in index order

    @property
    def array_id(self) -> str:
        return self.submitted.array_id


@dataclass
class Provisioning:
    """What the autoscaler did for queued jobs, as `why` tells it (A1, A4): the instances asked for each, and
    the latest news of them."""

    instances: dict[str, list[str]] = field(default_factory=dict)  # instance -> the jobs it was asked for
    news: dict[str, str] = field(default_factory=dict)  # job -> the latest sentence about its instances

    def apply(self, envelope: EventEnvelope) -> bool:
        event, at = envelope.event, envelope.recorded_at
        if isinstance(event, InstanceRequested):
            self.instances[event.instance] = list(event.jobs)
            sentence = (f"The autoscaler asked {event.provider} for instance {event.instance} ({event.instance_type}) "
                        f"for it at {at:%H:%M:%S} UTC.")
        elif isinstance(event, InstanceReady):
            sentence = f"Its instance {event.instance} joined the cluster at {at:%H:%M:%S} UTC."
        elif isinstance(event, ProvisionFailed):
            sentence = f"Its instance {event.instance} ({event.instance_type}) could not be started: {event.reason}."
            if event.retry_after is not None:
                sentence += (f" No {event.instance_type} is asked for before {event.retry_after:%H:%M:%S} UTC; "
                             "other types serving its flavors are tried meanwhile.")
        elif isinstance(event, InstanceReleased) and event.cause == "boot-timeout":
            sentence = f"Its instance {event.instance} never joined the cluster: {event.reason}."
        else:
            if isinstance(event, InstanceReleased):  # gone: nothing more will be told of it
                self.instances.pop(event.instance, None)
            return isinstance(event, InstanceLaunched | InstanceReleased | InstanceDraining | InstanceKept)
        for job_id in self.instances.get(event.instance, []):
            self.news[job_id] = sentence
        if isinstance(event, InstanceReleased):
            self.instances.pop(event.instance, None)
        return True


@dataclass
class SchedulerState:
    cluster: ClusterConfig
    jobs: dict[str, Job] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    settings: AdminSettings = field(default_factory=AdminSettings)
    storage: dict[tuple[str, str], StoredAccess] = field(default_factory=dict)  # J2: (kind, name) -> owner
    images: dict[str, ImageRecord] = field(default_factory=dict)  # J10: the catalogue, by NAME:TAG
    provisioning: Provisioning = field(default_factory=Provisioning)  # A1: instances asked for queued jobs
    # D1 locality: what each node's dataset cache holds (node -> entry key -> (source, bytes)).
    cached: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)
    preloads: dict[str, DatasetPreloadRequested] = field(default_factory=dict)  # D2, by preload id
    # S6: jobs whose prediction is still to be recorded, oldest first (a dict as an ordered set).
    unpredicted: dict[str, None] = field(default_factory=dict)
    # The jobs not ended yet, by id: what cycles look at, however many jobs ended before.
    active: dict[str, Job] = field(default_factory=dict)
    arrays: dict[str, Array] = field(default_factory=dict)  # job arrays, by array id
    # Moves on with every event that changes what a cycle decides on (not with those that only tell how a job's
    # processes are doing, its prediction or the autoscaler's news).
    revision: int = field(default=0, compare=False)
    # Kept up to date as the jobs' events are folded, so that a cycle reads them rather than working them out
    # from every job: the queue in start order (S1), the jobs holding resources in submission order, what each
    # of those holds per node, and what is held on each node (their sum, in that order).
    _queue: _Ordered[Job] = field(default_factory=_Ordered, init=False, compare=False, repr=False)
    _holding: _Ordered[Job] = field(default_factory=_Ordered, init=False, compare=False, repr=False)
    _held: dict[str, dict[str, Resources]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _on_node: dict[str, dict[str, Resources]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _used: dict[str, Resources] = field(default_factory=dict, init=False, compare=False, repr=False)
    # What the decision logic was last given of the nodes (decision_inputs.node_capacity): the schedulable nodes with
    # what is free on each, where each stands in that list, and the nodes where what is held changed since (None:
    # any node may have changed, as after a node event).
    capacity_as: list[NodeCapacity] = field(default_factory=list, init=False, compare=False, repr=False)
    capacity_at: dict[str, int] = field(default_factory=dict, init=False, compare=False, repr=False)
    capacity_changed: set[str] | None = field(default=None, init=False, compare=False, repr=False)
    # Likewise of the jobs holding resources (decision_inputs.running_jobs_changed).
    given_running: GivenRunning = field(default_factory=GivenRunning, init=False, compare=False, repr=False)
    _flavors: dict[str, Flavor] = field(default_factory=dict, init=False, compare=False, repr=False)
    # How many jobs are in each status, kept as their events are folded (the `trainyard.jobs` gauge), not counted
    # from every job there ever was.
    _by_status: Counter[str] = field(default_factory=Counter, init=False, compare=False, repr=False)
    # The ended jobs still held, in the order of their ends: the oldest are archived first (rules/archive.py).
    _ended_order: _Ordered[Job] = field(default_factory=_Ordered, init=False, compare=False, repr=False)
    # The scheduler's aggregates that left the state (an archived job, an array with its last job), for whoever
    # notes the aggregates' versions to forget theirs too (`take_left`).
    left: list[tuple[str, str]] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for flavor in reversed(self.cluster.flavors):  # by name; the first of a name, as ClusterConfig.flavor
            self._flavors[flavor.name] = flavor

    # --- folding events --------------------------------------------------------------------------

    def apply(self, envelope: EventEnvelope) -> None:
        """Fold one event; `revision` moves on when it changed anything a cycle decides on."""
        event = envelope.event
        at = envelope.recorded_at
        if fold_node_event(self.nodes, event):
            self.revision += 1
            self.capacity_changed = None
            return
        if self.provisioning.apply(envelope):
            return
        if isinstance(event, DatasetCached):
            self.cached.setdefault(event.node, {})[event.entry.key] = (event.entry.source, event.entry.bytes)
            self.revision += 1
            return
        if isinstance(event, DatasetEvicted):
            self.cached.get(event.node, {}).pop(event.eviction.key, None)
            self.revision += 1
            return
        if isinstance(event, SettingsChanged):
            self.settings = event.settings
            return
        if isinstance(event, DatasetPreloadRequested):
            self.preloads[event.preload_id] = event
            return
        if isinstance(event, StorageAccessSet):
            self.storage[(event.entry.kind, event.entry.name)] = event.entry
            return
        if isinstance(event, ImageRegistered | ImageMarked | ImageDeleted):
            self.images = fold_image(self.images, event)
            return
        if isinstance(event, ArraySubmitted):
            self.arrays[event.array_id] = Array(submitted=event, submitted_at=at)
            self.revision += 1
            return
        if isinstance(event, JobSubmitted):
            if (replaced := self.jobs.get(event.job_id)) is not None:
                self._by_status[replaced.status] -= 1
            self._by_status["queued"] += 1
            self.jobs[event.job_id] = Job(job_id=event.job_id, spec=event.spec, creator=event.creator,
                                          submitted_at=at, queue_order=envelope.position,
                                          trace=envelope.trace, priority=event.spec.priority,
                                          duration=event.spec.duration, cloned_from=event.cloned_from,
                                          image=event.image)
            self.unpredicted[event.job_id] = None
            self.active[event.job_id] = self.jobs[event.job_id]
            if event.array is not None:  # (a job read back from the log alone has no array beside it)
                self.jobs[event.job_id].array = event.array
                if (array := self.arrays.get(event.array.array_id)) is not None:
                    array.jobs[event.array.index] = event.job_id
        job = self.jobs.get(getattr(event, "job_id", ""))
        if job is None:
            return
        if isinstance(event, JobArchived):
            self._archive(job)
            return
        if envelope.service == SERVICE:
            was = job.status
            self._apply_job_event(job, envelope)
            if job.status != was:
                self._by_status[was] -= 1
                self._by_status[job.status] += 1
            if not isinstance(event, JobPredicted):  # a prediction changes nothing a cycle decides on
                self._derive(job)
                self.revision += 1
        elif envelope.service == "launcher":
            if self._apply_launch_event(job, envelope):
                job.changed()
                if job.job_id in self._holding.key_of:
                    self.given_running.touch(job.job_id)
                self.revision += 1
        elif isinstance(event, DebugEnvironmentKept):
            job.kept_until = event.until
        elif isinstance(event, DebugEnvironmentReleased):
            job.kept_until = None

    def stored_at(self, envelope: EventEnvelope, sequence: int) -> None:
        """Another service's event about a job held is stored at `sequence` of the events stream (`Job.published`)."""
        if (sequence and envelope.aggregate_type in ABOUT_JOBS and envelope.service != SERVICE
                and (job := self.jobs.get(envelope.aggregate_id)) is not None
                and (not job.published or job.published[-1] < sequence)):
            job.published.append(sequence)

    def take_left(self) -> list[tuple[str, str]]:
        """The aggregates that left the state since the last time asked (see `left`)."""
        taken, self.left = self.left, []
        return taken

    def ended_in_order(self) -> Sequence[Job]:
        """The ended jobs still held, oldest end first."""
        return self._ended_order.jobs

    def status_counts(self) -> Mapping[str, int]:
        """How many jobs are in each status (a status no job is in may be missing, or 0)."""
        return self._by_status

    def _derive(self, job: Job) -> None:
        """Bring what is derived from `job` up to date after one of its events."""
        job.changed()
        job_id = job.job_id
        if job.status == "queued" and job.precheck is None and self.active.get(job_id) is job:
            self._queue.put(job, (job.rank, job.queue_order, job_id))
        else:
            self._queue.discard(job_id)
        holds = (job.status == "running" or job.prechecking) and self.active.get(job_id) is job
        if holds or job_id in self._holding.key_of:
            self.given_running.touch(job_id)
        if holds:
            self._holding.put(job, (0, job.queue_order, job_id))
        else:
            self._holding.discard(job_id)
        held = self.holdings(job) if holds else {}
        before = self._held.pop(job_id, {})
        if held:
            self._held[job_id] = held
        for node in before.keys() | held.keys():
            if before.get(node) != held.get(node):
                self._hold(node, job_id, held.get(node))

    def _hold(self, node: str, job_id: str, amount: Resources | None) -> None:
        """What `job_id` holds on `node` is now `amount`; the node's sum is made again, in submission order, so
        that it is exactly what adding up its jobs gives."""
        on_node = self._on_node.setdefault(node, {})
        if amount is None:
            on_node.pop(job_id, None)
        else:
            on_node[job_id] = amount
        if self.capacity_changed is not None:
            self.capacity_changed.add(node)
        if not on_node:
            del self._on_node[node], self._used[node]
            return
        total = Resources()
        for key in sorted(self._holding.key_of[holder] for holder in on_node):
            total = total + on_node[key[2]]
        self._used[node] = total

    def _apply_job_event(self, job: Job, envelope: EventEnvelope) -> None:
        event = envelope.event
        at = envelope.recorded_at
        if isinstance(event, JobAdmitted):
            job.status = "running"
            job.attempt = event.attempt
            job.flavor = event.flavor
            job.placement = list(event.placement)
            job.dropped_flavors = list(event.dropped_flavors)
            job.started_at = job.started_at or at  # a moved, grown or restarted job keeps its first start
            job.running_since = job.running_since or at
            job.reason, job.failed_precheck, job.unexplained_failure = None, None, None
            job.precheck = job.resuming = job.restarting = job.rescaling = None
            job.instances = {p.rank: Instance(rank=p.rank, node=p.node, role=p.role) for p in event.placement}
            job.last_exit_at = None
        elif isinstance(event, JobPrechecking):
            job.precheck = event
        elif isinstance(event, JobPrecheckFailed):
            if job.precheck is not None and job.precheck.attempt == event.attempt:
                job.precheck, job.reason = None, event.reason
                job.failed_precheck = (at, list(event.nodes))
        elif isinstance(event, JobResuming):
            job.resuming, job.unexplained_failure = event, None
            job.excluded_nodes.extend(n for n in event.exclude_nodes if n not in job.excluded_nodes)
        elif isinstance(event, JobRequeued):
            # Back in the queue at its old place (queue_order is kept), holding nothing.
            job.status, job.reason, job.resumes = "queued", event.reason, event.resumes
            if job.running_since is not None:
                job.ran_before += at - job.running_since
            job.running_since = None
            job.flavor, job.placement, job.instances = None, [], {}
            job.resuming = job.restarting = job.rescaling = None
            job.stop_requested_by, job.expiring = None, False
        elif isinstance(event, JobRestarting):
            job.restarting, job.restarts = event, event.restarts
        elif isinstance(event, JobPredicted):
            job.prediction = event.prediction
            self.unpredicted.pop(job.job_id, None)
        elif isinstance(event, JobPriorityChanged):
            job.priority, job.rank = event.priority, PRIORITY_RANK[event.priority]
        elif isinstance(event, JobDurationChanged):
            job.duration = event.duration
        elif isinstance(event, JobExpiring):
            job.expiring = True
        elif isinstance(event, JobExpired):
            job.status, job.ended_at, job.reason = "expired", at, event.reason
            job.expiring = False
            self._ended(job)
        elif isinstance(event, JobRescaling):
            job.rescaling = event
        elif isinstance(event, JobStopRequested):
            job.stop_requested_by = event.by
        elif isinstance(event, JobSucceeded):
            job.status, job.ended_at, job.exit_code = "succeeded", _ended_at(job, at), 0
            self._ended(job)
        elif isinstance(event, JobFailed):
            job.status, job.ended_at = "failed", _ended_at(job, at) if event.exit_code is not None else at
            job.reason, job.exit_code = event.reason, event.exit_code
            self._ended(job)
        elif isinstance(event, JobStopped):
            job.status, job.ended_at, job.reason = "stopped", at, event.reason
            self._ended(job)
        elif isinstance(event, JobDeleted):
            job.deleted = True
            self.unpredicted.pop(job.job_id, None)

    def _ended(self, job: Job) -> None:
        job.precheck = job.resuming = job.restarting = job.rescaling = None
        job.unexplained_failure, job.queued_as = None, None
        self.active.pop(job.job_id, None)
        if job.ended_at is not None:
            self._ended_order.put(job, (_microseconds(job.ended_at), job.queue_order, job.job_id))
        if job.started_at is None:  # it never started: no prediction is needed any more
            self.unpredicted.pop(job.job_id, None)

    def _archive(self, job: Job) -> None:
        """The job leaves the state (it ended long ago): nothing of it stays in memory but its count by status.
        An array leaves with its last job."""
        job_id = job.job_id
        del self.jobs[job_id]
        for kept in (self.active, self.unpredicted, self.provisioning.news):
            kept.pop(job_id, None)
        self._queue.discard(job_id)
        if job_id in self._holding.key_of:
            self.given_running.touch(job_id)
        self._holding.discard(job_id)
        self._ended_order.discard(job_id)
        self.left.append((JOB, job_id))
        if job.array is not None and (array := self.arrays.get(job.array.array_id)) is not None:
            array.jobs.pop(job.array.index, None)
            if not array.jobs:
                del self.arrays[array.array_id]
                self.left.append((ARRAY, array.array_id))

    def _apply_launch_event(self, job: Job, envelope: EventEnvelope) -> bool:
        """Fold one of the launcher's events about `job`; whether it changed when the job must end (J14) or a
        failure still to settle (J12): the rest only shows how its processes are doing."""
        event = envelope.event
        if getattr(event, "attempt", None) != job.attempt:
            return False
        if isinstance(event, LaunchPlanned):
            for rank, node, role in event.ranks():
                job.instances.setdefault(rank, Instance(rank=rank, node=node)).role = role
        elif isinstance(event, NodeProcessStarted):
            # A batch job's ranks start once per task: the instance shows the task running now.
            instance = job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node))
            instance.pid, instance.exit_code = event.pid, None
            if event.staged:
                job.staging_seconds[event.attempt] = max(job.staging_seconds.get(event.attempt, 0.0),
                                                         event.staging_seconds)
                return True
        elif isinstance(event, NodeProcessExited):
            instance = job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node))
            instance.exit_code = event.exit_code
            if event.exited_at is not None:
                job.last_exit_at = max(job.last_exit_at or event.exited_at, event.exited_at)
        elif isinstance(event, NodeProcessLost):
            job.instances.setdefault(event.rank, Instance(rank=event.rank, node=event.node)).lost = True
        elif isinstance(event, LaunchFailed) and job.spec.checkpoint_resume is not None and job.status == "running":
            job.unexplained_failure = (event, envelope.recorded_at)
            return True
        return False

    # --- queries ---------------------------------------------------------------------------------

    def data_on_nodes(self, spec: JobSpec) -> dict[str, int]:
        """D1 locality: per node, the bytes of the datasets `spec` stages that its cache holds (a dataset
        cached in several versions counts once, by its largest copy)."""
        if not spec.data_preparation:
            return {}
        sources = set(staged_sources(spec))
        found: dict[str, int] = {}
        for node, entries in self.cached.items():
            largest: dict[str, int] = {}
            for source, size in entries.values():
                if source in sources:
                    largest[source] = max(largest.get(source, 0), size)
            if largest:
                found[node] = sum(largest.values())
        return found

    def flavor(self, name: str) -> Flavor | None:
        return self._flavors.get(name)

    @property
    def flavors(self) -> dict[str, Flavor]:
        """The cluster's flavors by name (not to be changed)."""
        return self._flavors

    def queue(self) -> list[Job]:
        """Queued jobs in start order (S1); a job being pre-checked has left it."""
        return list(self._queue.jobs)

    def queue_position(self, job: Job) -> int | None:
        """Where a queued job stands in the queue, from 1."""
        index = self._queue.index(job.job_id)
        return None if index is None else index + 1

    def running(self) -> list[Job]:
        """Running jobs, in submission order."""
        return [j for j in self._holding.jobs if j.status == "running"]

    def holding(self) -> list[Job]:
        """Jobs that hold resources: running ones and those being pre-checked, in submission order."""
        return list(self._holding.jobs)

    def holding_key(self, job_id: str) -> tuple[int, int, str] | None:
        """Where a job holding resources stands among them (`holding`); None: it holds none."""
        return self._holding.key_of.get(job_id)

    def placements(self, job: Job) -> list[tuple[str, list[Placement]]]:
        """What a job holds, as (flavor, placement): its current placement, and while it is being moved
        (S10) the one it moves to; while it is pre-checked, the placement being checked."""
        if job.status == "queued":
            return [(job.precheck.flavor, list(job.precheck.placement))] if job.precheck else []
        held = [(job.flavor or "", list(job.placement))]
        if job.rescaling is not None:
            held.append((job.rescaling.flavor, list(job.rescaling.placement)))
        return held

    def holdings(self, job: Job) -> dict[str, Resources]:
        """What a job holds per node, so that nothing else takes those resources meanwhile."""
        held: dict[str, Resources] = {}
        for flavor_name, placement in self.placements(job):
            flavor = self.flavor(flavor_name)
            if flavor is None:
                continue
            for node, amount in placement_holdings(placement, flavor).items():
                held[node] = held.get(node, Resources()) + amount
        return held

    def used_on(self, node: str) -> Resources | None:
        """What running and pre-checked jobs hold on `node`; None when nothing. The object changes when that does."""
        return self._used.get(node)

    def used(self) -> dict[str, Resources]:
        """Resources held per node by running and pre-checked jobs."""
        used: dict[str, Resources] = {name: Resources() for name in self.nodes}
        used.update(self._used)
        return used

    def jobs_on(self, node: str) -> list[Job]:
        """Running jobs with a rank on `node`."""
        return [j for j in self.running() if any(p.node == node for p in j.placement)]

    def schedulable(self, node: str) -> bool:
        known = self.nodes.get(node)
        return known is not None and known.schedulable

    def unusable(self, placement: list[Placement]) -> list[str]:
        """The nodes of `placement` that may take no work now (unknown, lost or unhealthy), once each."""
        return [n for n in dict.fromkeys(p.node for p in placement) if not self.schedulable(n)]

    def avoided_nodes(self, job: Job, now: datetime, recheck_after: timedelta) -> frozenset[str]:
        """Where the job may not be placed now: nodes it was moved away from, and for a while after a
        failed pre-check (M1) the nodes that failed it, so it tries others instead of the same again."""
        recent = job.failed_precheck is not None and now < job.failed_precheck[0] + recheck_after
        if not job.excluded_nodes and not recent:
            return NO_NODES
        avoided = set(job.excluded_nodes)
        if recent and job.failed_precheck is not None:
            avoided.update(job.failed_precheck[1])
        return frozenset(avoided)

    def max_resumes(self, job: Job) -> int | None:
        """J12/M4: the job's maximum resumes within the administrator's cap; None without checkpoint resume."""
        resume = job.spec.checkpoint_resume
        return None if resume is None else min(resume.max_resumes, self.settings.max_resumes_cap)

    def view(self, job: Job) -> JobView:
        queue_position = self.queue_position(job) if job.status == "queued" else None
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
            resumes=job.resumes, max_resumes=self.max_resumes(job), restarts=job.restarts,
            excluded_nodes=list(job.excluded_nodes), kept_until=job.kept_until, array=job.array,
            image=f"{job.image.ref}@{job.image.digest}" if job.image is not None else None,
            instances=[
                InstanceView(rank=i.rank, node=i.node, master=i.rank == 0, state=i.state,  # type: ignore[arg-type]
                             pid=i.pid, exit_code=i.exit_code, role=i.role)
                for i in sorted(job.instances.values(), key=lambda i: i.rank)
            ],
        )
