"""Domain events: every change of state in Trainyard is one of these (SPEC X1).

Events are stored in each service's PostgreSQL event log and published to JetStream on
`trainyard.events.<service>.<aggregate>.<EventName>` (see `subjects`). They are tagged with a
versioned name (`JobSubmitted.v1`): a changed meaning gets a new tag, never a silent edit. Stored
events tolerate unknown fields so that older readers survive newer writers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.arrays import ArrayMember, SweepParameter
from libs.contracts.cluster import MAX_JOB_UID, NodeInfo, Resources
from libs.contracts.datacache import CacheEntry, CacheEviction, StagedDataset
from libs.contracts.health import AlertKind, NodeCheck
from libs.contracts.images import ImageRecord, ImageUse
from libs.contracts.jobspec import JobSpec, Priority
from libs.contracts.scheduling import AdminSettings, Prediction, StoredAccess


class _Event(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of all events; `type` carries the versioned tag."""

    @classmethod
    def name(cls) -> str:
        """The event name used as the last token of its subject."""
        return cls.__name__


Role = Literal["worker", "ps", "standby"]
"""worker: must succeed; ps: a TensorFlow parameter server; standby: holds a node for processes the
master starts there (MPI), and is stopped when the workers are done."""


class Placement(Struct, frozen=True, kw_only=True):
    """Where one rank of a job runs. TensorFlow parameter servers (J8) are ranks with role "ps",
    numbered after the workers and sized by the fixed parameter-server flavor."""

    rank: int
    node: str
    address: str
    slots: int
    role: Role = "worker"


# --- scheduler: aggregate "job" -----------------------------------------------------------------


class JobSubmitted(_Event, frozen=True, tag="JobSubmitted.v1"):
    """A job was accepted and queued (S12 `queued`)."""

    job_id: str
    spec: JobSpec
    creator: str
    cloned_from: str | None = None  # O1: the job this one was cloned from
    creator_email: str | None = None  # where alerts about the job go (M7)
    array: ArrayMember | None = None  # the array it belongs to, and its index there
    image: ImageUse | None = None  # J10: the image its spec names, as the catalogue had it then


class ArraySubmitted(_Event, frozen=True, tag="ArraySubmitted.v1"):
    """An array of jobs was accepted (aggregate `array`); its jobs' JobSubmitted follow in the same append."""

    array_id: str
    job_name: str  # the spec's name, `{index}` left in it
    project: str
    creator: str
    indices: str  # its indices as an array expression
    size: int
    sweep: list[SweepParameter] = msgspec.field(default_factory=list)
    max_running: int | None = None


class JobPredicted(_Event, frozen=True, tag="JobPredicted.v1"):
    """S6: what the scheduler predicted for the job when it was queued (kept to measure accuracy)."""

    job_id: str
    prediction: Prediction


class JobAdmitted(_Event, frozen=True, tag="JobAdmitted.v1"):
    """All nodes of the job were placed at once (S4); it is now `running`."""

    job_id: str
    attempt: int
    flavor: str
    placement: list[Placement]
    dropped_flavors: list[str] = msgspec.field(default_factory=list)  # S5: its other flavors, given up
    backfilled: bool = False  # started ahead of a waiting job without delaying that job's reservation


class JobPriorityChanged(_Event, frozen=True, tag="JobPriorityChanged.v1"):
    """S3: a queued job's priority was changed; it keeps its submission order within the level."""

    job_id: str
    priority: Priority
    by: str


class JobDurationChanged(_Event, frozen=True, tag="JobDurationChanged.v1"):
    """S11: the duration limit changed (None: no limit); a running job goes on without a restart."""

    job_id: str
    duration: str | None
    by: str


class JobExpiring(_Event, frozen=True, tag="JobExpiring.v1"):
    """J16: a running job passed its duration limit; the launcher is stopping its processes."""

    job_id: str
    attempt: int
    limit_seconds: int


class JobExpired(_Event, frozen=True, tag="JobExpired.v1"):
    """J16: the processes of a job past its duration limit were stopped (S12 `expired`)."""

    job_id: str
    reason: str


class JobRescaling(_Event, frozen=True, tag="JobRescaling.v1"):
    """S10: an elastic job moves to a new placement; the launcher stops the current attempt, and the
    scheduler admits the next attempt on `placement` (held for it meanwhile) once it has stopped."""

    job_id: str
    attempt: int
    flavor: str
    placement: list[Placement]
    reason: str


class JobPrechecking(_Event, frozen=True, tag="JobPrechecking.v1"):
    """M1: a checkpoint-resume job was placed; its nodes are held while the monitor pre-checks them.
    A passed pre-check admits it as `attempt` on `placement`; a failed one puts it back in the queue."""

    job_id: str
    attempt: int
    flavor: str
    placement: list[Placement]
    dropped_flavors: list[str] = msgspec.field(default_factory=list)


class JobPrecheckFailed(_Event, frozen=True, tag="JobPrecheckFailed.v1"):
    """M1: the pre-check failed on `nodes`; the job waits in the queue again with the reason."""

    job_id: str
    attempt: int
    reason: str
    nodes: list[str]


class JobResuming(_Event, frozen=True, tag="JobResuming.v1"):
    """J12/M2: a node of a checkpoint-resume job is unhealthy (or slow, M6). The launcher sends the
    checkpoint signal to every process, waits the graceful shutdown time, then kills; processes on
    `lost_nodes` cannot be reached and are given up at once. Placements avoid `exclude_nodes`.
    `fault_nodes` are the nodes whose fault moves the job (lost, unhealthy or slow); empty in events
    recorded before it was added."""

    job_id: str
    attempt: int
    reason: str
    lost_nodes: list[str] = msgspec.field(default_factory=list)
    exclude_nodes: list[str] = msgspec.field(default_factory=list)
    fault_nodes: list[str] = msgspec.field(default_factory=list)
    # J14: the attempt failed before its command started, for a fault of a node (its data could not be
    # prepared there): the job, of any kind, waits for other nodes, and it does not count as a resume.
    before_start: bool = False


class JobRequeued(_Event, frozen=True, tag="JobRequeued.v1"):
    """The stopped attempt of a resuming (or restarting) job is down; the job waits in the queue for
    healthy nodes (S12 `queued`), keeping its place. `resumes` counts the job's resumes so far (M4)."""

    job_id: str
    attempt: int
    reason: str
    resumes: int = 0


class JobRestarting(_Event, frozen=True, tag="JobRestarting.v1"):
    """J13/M5: the command failed and the job restarts (`restarts` of its maximum so far): the rest of
    the attempt is stopped, then the next attempt starts on the same nodes (or waits for healthy ones)."""

    job_id: str
    attempt: int
    restarts: int
    reason: str
    exit_code: int | None = None


class JobStopRequested(_Event, frozen=True, tag="JobStopRequested.v1"):
    """A user asked to stop a running job; the launcher is stopping its processes."""

    job_id: str
    by: str


class JobSucceeded(_Event, frozen=True, tag="JobSucceeded.v1"):
    job_id: str


class JobFailed(_Event, frozen=True, tag="JobFailed.v1"):
    job_id: str
    reason: str
    exit_code: int | None = None


class JobStopped(_Event, frozen=True, tag="JobStopped.v1"):
    job_id: str
    by: str
    reason: str = "stopped by user"


class JobDeleted(_Event, frozen=True, tag="JobDeleted.v1"):
    job_id: str
    by: str


class JobArchived(_Event, frozen=True, tag="JobArchived.v1"):
    """The job ended more than the administrator's `job_retention` ago (and keeps no debug environment): it
    leaves every service's state in memory. Its history stays in the event log and the search read model, from
    which `show`, `events`, `logs`, `metrics` and `search` answer for it from then on."""

    job_id: str
    retention: str  # what it was kept for after its end


# --- scheduler: aggregate "settings" (id = "platform") ---------------------------------------------


class SettingsChanged(_Event, frozen=True, tag="SettingsChanged.v1"):
    """An administrator changed the platform settings; `settings` is the whole new set."""

    settings: AdminSettings
    by: str


# --- scheduler: aggregate "storage" (id = "catalog") -----------------------------------------------


class StorageAccessSet(_Event, frozen=True, tag="StorageAccessSet.v1"):
    """J2: a resource of shared storage was registered to an owner, or its access for others changed;
    `entry` is the whole new registration."""

    entry: StoredAccess
    by: str


# --- scheduler: aggregate "images" (id = "catalog") ----------------------------------------------------


class ImageRegistered(_Event, frozen=True, tag="ImageRegistered.v1"):
    """J10: an image joined the catalogue, or its NAME:TAG was given a new archive; `image` is the whole record."""

    image: ImageRecord
    by: str


class ImageMarked(_Event, frozen=True, tag="ImageMarked.v1"):
    """J10: an image was marked for training jobs (`training`), or the mark was taken away."""

    ref: str
    training: bool
    by: str


class ImageDeleted(_Event, frozen=True, tag="ImageDeleted.v1"):
    """J10: an image left the catalogue; jobs accepted with it keep it (ImageUse)."""

    ref: str
    by: str


# --- scheduler: aggregate "preload" (id = the preload's id) -------------------------------------------


class DatasetPreloadRequested(_Event, frozen=True, tag="DatasetPreloadRequested.v1"):
    """D2: `source` (a dataset folder of shared storage) is to be copied into the caches of `nodes` ahead of
    the jobs that read it; the monitor asks their agents."""

    preload_id: str
    source: str
    nodes: list[str]
    by: str


# --- scheduler: aggregate "drain" (id = node name) --------------------------------------------------


class NodeDrained(_Event, frozen=True, tag="NodeDrained.v1"):
    """A3: the scheduler places nothing more on the autoscaler's draining instance `node`. Every admission
    to it comes before this event in the scheduler's log: whoever has read up to here knows all of them."""

    node_name: str
    instance: str


# --- launcher: aggregate "launch" (id = job id) ---------------------------------------------------


class Mount(Struct, frozen=True, kw_only=True):
    """A storage path (relative to the shared storage root) shown inside the workspace."""

    source: str
    target: str
    read_only: bool
    # J14: copied into the node's dataset cache before the command starts, and read there (read-only).
    stage: bool = False


class NodeLaunch(Struct, frozen=True, kw_only=True):
    """What one node of a job is started with."""

    rank: int
    node: str
    address: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    files: dict[str, str] = msgspec.field(default_factory=dict)
    master: bool = False
    role: Role = "worker"
    task: int = 0  # J3: which task of a batch job (0 for a regular job)
    # J15: keep the workspace after the process ends (debug terminal) until the monitor releases it.
    keep_workspace: bool = False
    # The port this rank listens on for the job's rendezvous (the master port, a TF task's port), chosen on
    # its node (ReservePorts); 0: none.
    port: int = 0
    image: ImageUse | None = None  # J10: run inside this image (None: on the node's own files)
    # L1: the user (and group) id its processes run as where its agent runs as root (cluster config `job_users`);
    # None from a launcher before it: the agent then takes the job's own, by the default settings.
    run_as: Annotated[int, Meta(ge=1, le=MAX_JOB_UID)] | None = None


def launched_role(mode: str, rank: int, placed: Role) -> Role:
    """The role a rank is launched in: under Horovod the master's mpirun starts the processes of every node, whose
    own launch only holds the node (standby); elsewhere the role it was placed in."""
    return "standby" if mode == "horovod" and rank > 0 else placed


class LaunchHost(Struct, frozen=True, array_like=True):
    """Where one rank of a launch runs, encoded as a short array (the rank is its index in LaunchShape.hosts):
    a launch of 10,000 nodes records some 40 bytes for each."""

    node: str
    address: str
    slots: int
    role: Role = "worker"
    port: int = 0  # the rendezvous port it listens on, chosen on its node (NodeLaunch.port); 0: none


class LaunchTask(Struct, frozen=True, kw_only=True):
    """What every node of one task runs (a regular job has one task), before its mode fits it to each node."""

    command: str
    mounts: list[Mount]


class LaunchShape(Struct, frozen=True, kw_only=True):
    """Everything every node's launch of an attempt is derived from, recorded once: where each rank runs and what
    all of them share. A node's environment, hostfiles and TF_CONFIG are worked out from it when the node is
    started (services/launcher/planner.py), so the record grows with the node count, not with its square."""

    hosts: list[LaunchHost]
    slots: int  # the flavor's: processes per node (torch.distributed.launch, mpirun -np)
    env: dict[str, str]
    tasks: list[LaunchTask]
    wrapper: list[str] = msgspec.field(default_factory=list)  # J18: the lifecycle scripts' runner, before the argv
    keep_workspace: bool = False  # J15
    image: ImageUse | None = None  # J10
    run_as: Annotated[int, Meta(ge=1, le=MAX_JOB_UID)] | None = None  # L1


class LaunchPlanned(_Event, frozen=True, tag="LaunchPlanned.v1"):
    """The launcher worked out what every node of the attempt runs: its `shape`, from which each node's command,
    environment and workspace follow. Plans recorded before shapes hold every node's launch in `nodes` instead."""

    job_id: str
    attempt: int
    mode: str
    nodes: list[NodeLaunch] = msgspec.field(default_factory=list)
    # The rendezvous port each listening rank got on its node (rank -> port; see NodeLaunch.port), in plans
    # without a shape. Launches planned before ports were chosen on the nodes held base_port .. base_port + ranks
    # - 1 instead.
    ports: dict[int, int] = msgspec.field(default_factory=dict)
    base_port: int = 0
    shape: LaunchShape | None = None

    def rank_ports(self) -> dict[int, int]:
        """The rendezvous port of each rank that listens on one, whichever form the plan has."""
        if self.shape is not None:
            return {rank: host.port for rank, host in enumerate(self.shape.hosts) if host.port}
        if self.ports or not self.base_port:
            return dict(self.ports)
        return {rank: self.base_port + rank for rank in {n.rank for n in self.nodes}}

    def ranks(self) -> list[tuple[int, str, Role]]:
        """(rank, node, role launched in) of every rank, once each, whichever form the plan has."""
        if self.shape is not None:
            return [(rank, host.node, launched_role(self.mode, rank, host.role))
                    for rank, host in enumerate(self.shape.hosts)]
        return list({n.rank: (n.rank, n.node, n.role) for n in self.nodes}.values())


class NodeProcessStarted(_Event, frozen=True, tag="NodeProcessStarted.v1"):
    job_id: str
    attempt: int
    rank: int
    node: str
    pid: int
    backend: str = "plain"  # the workspace backend the agent used (L1)
    task: int = 0
    image: str | None = None  # J10: the image it ran in (NAME:TAG@digest), and whether it was unpacked for it
    image_unpacked: bool = False
    # J14: the datasets the node read from its cache, copied first unless they were there (a hit). The
    # time spent copying is not counted against the job's duration limit.
    staged: list[StagedDataset] = msgspec.field(default_factory=list)
    # When it started, by its node's clock, where the agent said (a start reported with the exit is recorded
    # after the process ended); None from older agents: the event's recording time stands for it.
    started_at: datetime | None = None

    @property
    def staging_seconds(self) -> float:
        """How long the node's data preparation took (its datasets were copied side by side)."""
        return max((dataset.seconds for dataset in self.staged), default=0.0)


class NodeProcessExited(_Event, frozen=True, tag="NodeProcessExited.v1"):
    job_id: str
    attempt: int
    rank: int
    node: str
    exit_code: int
    task: int = 0
    exited_at: datetime | None = None  # the agent's time of the exit (ProcessExited); None from older agents


class NodeProcessLost(_Event, frozen=True, tag="NodeProcessLost.v1"):
    """The launcher gave up on a process whose node stopped answering; its fate is unknown."""

    job_id: str
    attempt: int
    rank: int
    node: str
    reason: str
    task: int = 0


class LostProcessesStopped(_Event, frozen=True, tag="LostProcessesStopped.v1"):
    """The processes of an attempt given up on `node` (NodeProcessLost) are gone: the node's agent answered
    a stop for them once it was back. Until then the launcher keeps asking it, so an attempt given up
    never runs on beside the next one."""

    job_id: str
    attempt: int
    node: str


class LaunchSucceeded(_Event, frozen=True, tag="LaunchSucceeded.v1"):
    job_id: str
    attempt: int


class LaunchFailed(_Event, frozen=True, tag="LaunchFailed.v1"):
    job_id: str
    attempt: int
    reason: str
    exit_code: int | None = None
    # Nodes where a rank could not start for a fault of the node itself (J14: its data could not be
    # prepared there, e.g. a full disk), not of the job: the scheduler tries the job on other nodes.
    fault_nodes: list[str] = msgspec.field(default_factory=list)


class LaunchStopped(_Event, frozen=True, tag="LaunchStopped.v1"):
    job_id: str
    attempt: int


# --- monitor: aggregate "node" (id = node name) --------------------------------------------------


class NodeRegistered(_Event, frozen=True, tag="NodeRegistered.v1"):
    """A node agent announced itself (or its resources changed)."""

    node: NodeInfo


class NodeLost(_Event, frozen=True, tag="NodeLost.v1"):
    """A node stopped sending heartbeats; it is unschedulable until it returns."""

    node_name: str
    last_seen: datetime
    reason: str


class NodeRecovered(_Event, frozen=True, tag="NodeRecovered.v1"):
    node_name: str


class NodeRetired(_Event, frozen=True, tag="NodeRetired.v1"):
    """The node's instance was ended on purpose (the autoscaler released it): it is gone from the cluster,
    not lost; no alert. Its agent, should it speak again, registers anew."""

    node_name: str
    reason: str


class NodeUnhealthy(_Event, frozen=True, tag="NodeUnhealthy.v1"):
    """M2: a component of the node is faulty (probed or marked); the node is unschedulable and the
    checkpoint-resume jobs on it are moved. Recorded again when the list of problems changes."""

    node_name: str
    problems: list[str]


class NodeHealthy(_Event, frozen=True, tag="NodeHealthy.v1"):
    node_name: str


class NodeDiskPressure(_Event, frozen=True, tag="NodeDiskPressure.v1"):
    """D1: the node's disk is fuller than the platform allows, after its dataset cache evicted what it could:
    it takes no new work (its running jobs go on) until its agent reports the disk at or below the low
    threshold."""

    node_name: str
    reason: str


class NodeDiskRelieved(_Event, frozen=True, tag="NodeDiskRelieved.v1"):
    node_name: str


class ComponentMarked(_Event, frozen=True, tag="ComponentMarked.v1"):
    """An administrator marked a component faulty (or cleared the mark), e.g. for a drill."""

    node_name: str
    component: str  # <kind>:<name>, see libs.contracts.health
    faulty: bool
    by: str
    reason: str = ""


# --- monitor: aggregate "job" (id = job id) --------------------------------------------------------


class PrecheckCompleted(_Event, frozen=True, tag="PrecheckCompleted.v1"):
    """M1: the result of pre-checking every candidate node of a job's next attempt."""

    job_id: str
    attempt: int
    passed: bool
    nodes: list[NodeCheck]


class PerformanceDegraded(_Event, frozen=True, tag="PerformanceDegraded.v1"):
    """M6: hardware time / e2e time crossed the job's threshold over `window` iterations on `node`.
    Once per incident: recorded again only after the ratio went back and crossed again."""

    job_id: str
    attempt: int
    node: str
    rank: int
    ratio: float
    threshold: float
    direction: str
    window: int
    action: str  # alert | reschedule


class DebugEnvironmentKept(_Event, frozen=True, tag="DebugEnvironmentKept.v1"):
    """J15: the job ended abnormally with the debug terminal on; its node environments are kept."""

    job_id: str
    attempt: int
    nodes: list[str]
    until: datetime


class DebugEnvironmentReleased(_Event, frozen=True, tag="DebugEnvironmentReleased.v1"):
    """J15: the retention time is over; the agents removed the kept environments."""

    job_id: str
    attempt: int


# --- monitor: aggregate "run" (id = job id): the life of the job's one run (R1) ----------------------


class RunBegan(_Event, frozen=True, tag="RunBegan.v1"):
    """R1: the job's first process started: its run begins (once per job)."""

    job_id: str
    attempt: int
    began_at: datetime


class RunContinued(_Event, frozen=True, tag="RunContinued.v1"):
    """R1: a later attempt (a resume, a restart) started: it logs into the same run, which is open again if
    an earlier primary's end had finished it."""

    job_id: str
    attempt: int


class RunProcessEnded(_Event, frozen=True, tag="RunProcessEnded.v1"):
    """R1: one rank's process group of an attempt ended (`exit_code`), or was given up on with its node
    (None). A worker's end is only this: it never finishes the run."""

    job_id: str
    attempt: int
    task: int
    rank: int
    node: str
    exit_code: int | None
    ended_at: datetime


class RunFinished(_Event, frozen=True, tag="RunFinished.v1"):
    """R1: the run is finished, by its primary: rank 0 of every task ended well in one attempt, or the job
    ended (`by` says which)."""

    job_id: str
    attempt: int
    by: str
    finished_at: datetime


class RunLived(_Event, frozen=True, tag="RunLived.v1"):
    """R1: a whole run decided at once: it began, its processes ended and its primary finished it (a short job, whose
    start was reported with its exit). The same as RunBegan, each RunProcessEnded and RunFinished, in one event."""

    job_id: str
    attempt: int
    began_at: datetime
    ended: list[RunProcessEnded]
    finished: RunFinished


# --- monitor: aggregate "alert" (id = alert id, one per incident) ----------------------------------


class AlertRaised(_Event, frozen=True, tag="AlertRaised.v1"):
    """M7: one incident worth telling people about. Recorded in the monitor's log (published on
    `trainyard.events.monitor.alert.>` for the services that follow it), read by people through the
    monitor's ListAlerts, and mailed to `recipients`."""

    alert_id: str
    kind: AlertKind
    title: str
    message: str
    recipients: list[str] = msgspec.field(default_factory=list)
    job_id: str | None = None
    node: str | None = None


class AlertMailed(_Event, frozen=True, tag="AlertMailed.v1"):
    alert_id: str
    recipients: list[str]


# --- monitor: aggregate "cache" (id = node name) ----------------------------------------------------


class DatasetCached(_Event, frozen=True, tag="DatasetCached.v1"):
    """D1, D2: a node's agent copied a dataset into its cache (data preparation, or a preload)."""

    node: str
    entry: CacheEntry


class DatasetEvicted(_Event, frozen=True, tag="DatasetEvicted.v1"):
    """D1: a node's agent removed a cache entry: unused past the retention time, the cache above its high
    watermark, the disk under pressure, or the copy found unreadable."""

    node: str
    eviction: CacheEviction


# --- autoscaler: aggregate "instance" (id = the instance's name, which is also its node's) ---------------


class InstanceRequested(_Event, frozen=True, tag="InstanceRequested.v1"):
    """A1: the autoscaler asks its provider for an instance of `instance_type`, for the waiting `jobs` it
    lets start. Recorded before the provider is asked: the instance counts as on its way from here on."""

    instance: str
    instance_type: str
    provider: str
    jobs: list[str] = msgspec.field(default_factory=list)


class InstanceLaunched(_Event, frozen=True, tag="InstanceLaunched.v1"):
    """The provider started it: `provider_id` is its id there (an EC2 instance id, a local process)."""

    instance: str
    provider_id: str


class InstanceReady(_Event, frozen=True, tag="InstanceReady.v1"):
    """Its agent registered as `node` with the resources its type promises."""

    instance: str
    node: str


class InstanceDraining(_Event, frozen=True, tag="InstanceDraining.v1"):
    """A3: idle since `idle_since` past its type's idle time: the scheduler places nothing more on it."""

    instance: str
    node: str
    idle_since: datetime


class InstanceKept(_Event, frozen=True, tag="InstanceKept.v1"):
    """A drain called off: a job holds the node after all."""

    instance: str
    node: str
    reason: str


ReleaseCause = Literal["idle", "boot-timeout", "gone"]


class InstanceReleased(_Event, frozen=True, tag="InstanceReleased.v1"):
    """The provider was asked to end it: `idle` (A3), `boot-timeout` (its agent never registered), or `gone`
    (the provider no longer runs it)."""

    instance: str
    reason: str
    cause: ReleaseCause = "idle"


class ProvisionFailed(_Event, frozen=True, tag="ProvisionFailed.v1"):
    """The provider could not start it; `capacity`: it had none of that type (or no quota). The type waits until
    `retry_after` (longer after each failure in a row), and the next type serving the same flavors is tried."""

    instance: str
    instance_type: str
    reason: str
    capacity: bool = False
    retry_after: datetime | None = None
    failures: int = 1  # the type's failures in a row, this one included (a start ends the streak)


# --- autoscaler: aggregate "packing" (id = "queue") ------------------------------------------------------


class WaitingJobsPacked(_Event, frozen=True, tag="WaitingJobsPacked.v1"):
    """A1: where a decision packed the waiting jobs whose packing changed since the decision before: job ->
    node (an instance on its way included) -> what it would hold there; `unpacked`: waiting jobs packed
    before and no longer. The next decision, a restarted autoscaler's included, packs them the same way
    first, so it sees the room this one left and asks for nothing twice."""

    packed: dict[str, dict[str, Resources]] = msgspec.field(default_factory=dict)
    unpacked: list[str] = msgspec.field(default_factory=list)


# --- every service: aggregate "upstream" (id = `set_aside_id(consumer, sequence)`) -------------------

SetAsideCause = Literal["undecodable", "inconsistent", "conflict", "failed"]
"""undecodable: not a message of the expected type; inconsistent: its subject, its envelope and the
service followed there disagree (a forgery or a misrouted message); conflict: the reaction found the
aggregate changed (ConcurrencyConflict); failed: folding or reacting kept failing with an error that
is not a passing outage."""


def set_aside_id(consumer: str, sequence: int, part: int | None = None) -> str:
    """The aggregate id of a set-aside record: one per (consumer, stream sequence, event of a bundle), so it is decided
    once."""
    return f"{consumer}-{sequence}" if part is None else f"{consumer}-{sequence}.{part}"


class UpstreamMessageSetAside(_Event, frozen=True, tag="UpstreamMessageSetAside.v1"):
    """A message a service follows could not be applied; it was passed over (neither folded nor
    reacted to) and its tracking position recorded with this event. The monitor raises an alert."""

    consumer: str
    stream: str
    sequence: int
    subject: str
    cause: SetAsideCause
    reason: str
    claimed_service: str | None = None
    claimed_type: str | None = None
    part: int | None = None  # of a bundle (`subjects.bundle_subject`), the event set aside, from 0; None: the message


JobEvent = (JobSubmitted | JobPredicted | JobAdmitted | JobPriorityChanged | JobDurationChanged
            | JobStopRequested | JobSucceeded | JobFailed | JobStopped | JobDeleted | JobArchived | JobExpiring
            | JobExpired | JobRescaling | JobPrechecking | JobPrecheckFailed | JobResuming | JobRequeued
            | JobRestarting)
LaunchEvent = (LaunchPlanned | NodeProcessStarted | NodeProcessExited | NodeProcessLost | LostProcessesStopped
               | LaunchSucceeded | LaunchFailed | LaunchStopped)
NodeEvent = (NodeRegistered | NodeLost | NodeRecovered | NodeRetired | NodeUnhealthy | NodeHealthy | ComponentMarked
             | NodeDiskPressure | NodeDiskRelieved)
MonitorJobEvent = PrecheckCompleted | PerformanceDegraded | DebugEnvironmentKept | DebugEnvironmentReleased
RunEvent = RunBegan | RunContinued | RunProcessEnded | RunFinished | RunLived
AlertEvent = AlertRaised | AlertMailed
CacheEvent = DatasetCached | DatasetEvicted
InstanceEvent = (InstanceRequested | InstanceLaunched | InstanceReady | InstanceDraining | InstanceKept
                 | InstanceReleased | ProvisionFailed)
ImageEvent = ImageRegistered | ImageMarked | ImageDeleted
Event = (JobEvent | ArraySubmitted | SettingsChanged | StorageAccessSet | ImageEvent | DatasetPreloadRequested
         | NodeDrained | LaunchEvent | NodeEvent | MonitorJobEvent | RunEvent | AlertEvent | CacheEvent | InstanceEvent
         | WaitingJobsPacked | UpstreamMessageSetAside)

EVENT_TYPES: tuple[type[_Event], ...] = (
    JobSubmitted, ArraySubmitted, JobPredicted, JobAdmitted, JobPriorityChanged, JobDurationChanged, JobStopRequested,
    JobSucceeded, JobFailed, JobStopped, JobDeleted, JobArchived, JobExpiring, JobExpired, JobRescaling, JobPrechecking,
    JobPrecheckFailed, JobResuming, JobRequeued, JobRestarting, SettingsChanged, StorageAccessSet,
    ImageRegistered, ImageMarked, ImageDeleted,
    DatasetPreloadRequested, NodeDrained,
    LaunchPlanned, NodeProcessStarted, NodeProcessExited, NodeProcessLost, LostProcessesStopped, LaunchSucceeded,
    LaunchFailed, LaunchStopped,
    NodeRegistered, NodeLost, NodeRecovered, NodeRetired, NodeUnhealthy, NodeHealthy, ComponentMarked,
    NodeDiskPressure, NodeDiskRelieved,
    PrecheckCompleted, PerformanceDegraded, DebugEnvironmentKept, DebugEnvironmentReleased,
    RunBegan, RunContinued, RunProcessEnded, RunFinished, RunLived,
    AlertRaised, AlertMailed, DatasetCached, DatasetEvicted, InstanceRequested, InstanceLaunched, InstanceReady,
    InstanceDraining, InstanceKept,
    InstanceReleased, ProvisionFailed, WaitingJobsPacked, UpstreamMessageSetAside,
)


class EventEnvelope(Struct, frozen=True, kw_only=True):
    """An event as stored and as published: where it belongs and where it sits in its log."""

    event_id: str
    service: str
    aggregate_type: str
    aggregate_id: str
    version: int
    position: int
    recorded_at: datetime
    event: Event
    trace: dict[str, str] = msgspec.field(default_factory=dict)
