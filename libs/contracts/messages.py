"""Commands, queries and their typed replies (NATS request/reply, SPEC X6).

Requests forbid unknown fields: a client sending a field the service does not know gets a clear
error instead of having it ignored. Every reply is either the expected type or `CommandError`.
Requests name no user: the caller is the identity of the signed token in the request's headers
(`libs.contracts.identity`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.arrays import MAX_EXPRESSION_LENGTH, MAX_SWEEP_PARAMETERS, ArrayMember, SweepParameter
from libs.contracts.cluster import NodeInfo, Resources
from libs.contracts.datacache import CacheEntry, CopyUnderWay, StagingFailed
from libs.contracts.events import EventEnvelope, Mount, Placement
from libs.contracts.identity import Identity
from libs.contracts.images import (
    MAX_CHUNK_BYTES,
    MAX_DESCRIPTION,
    BoardName,
    Digest,
    ImageName,
    ImageRecord,
    ImageTag,
    UploadId,
)
from libs.contracts.jobspec import Access, FieldError, JobSpec, NodeName, Priority, ResourceName
from libs.contracts.scheduling import (
    AdminSettings,
    BoardDemand,
    FlavorInfo,
    NodeResources,
    Prediction,
    StoredAccess,
    StoredKind,
    WhyReport,
)

JobStatus = Literal["queued", "running", "succeeded", "failed", "stopped", "expired"]
JOB_STATUSES: tuple[JobStatus, ...] = ("queued", "running", "succeeded", "failed", "stopped", "expired")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "expired"})


MAX_ARRAY_PAGE = 2_000  # jobs of an array in one answer, well within one NATS message

PastInstant = Annotated[datetime, Meta(tz=True)]
"""`at` of a view (`trainyard at TIME …`): answer it as the scheduler would have at that instant, from the events
recorded up to it; None (the default) is now. It must name its time zone."""


class _Request(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every command and query."""


class SubmitJob(_Request, frozen=True, tag="SubmitJob.v1"):
    """Create a job. `job_id` is chosen by the client so that a retried submit is idempotent.

    `predict`: answer with the job's prediction (S6), planned before it joins the queue. Without it the
    prediction is planned after the job is accepted, together with those of other new jobs, and recorded
    a moment later (`trainyard show`)."""

    job_id: str
    spec: JobSpec
    predict: bool = False


class SubmitArray(_Request, frozen=True, tag="SubmitArray.v1"):
    """Create an array of jobs from one spec (libs/contracts/arrays.py): one job per index of `indices` (an
    array expression such as `0-999%50`), or per point of the cross product of `sweep`. `array_id` is chosen
    by the client so that a retried submit is idempotent; `max_running` caps how many run at once (a sweep's
    `%N`). Each job's spec is `spec` with its index and sweep values filled in; the whole array is refused,
    and nothing stored, when one of its jobs would be."""

    array_id: str
    spec: JobSpec
    indices: Annotated[str, Meta(max_length=MAX_EXPRESSION_LENGTH)] = ""
    sweep: Annotated[list[SweepParameter], Meta(max_length=MAX_SWEEP_PARAMETERS)] = msgspec.field(
        default_factory=list)
    max_running: Annotated[int, Meta(ge=1)] | None = None


class ArraySelection(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An array's jobs: all of them, or those of `indices` (an array expression, without `%N`)."""

    array_id: str
    indices: Annotated[str, Meta(max_length=MAX_EXPRESSION_LENGTH)] = ""


class StopJobs(_Request, frozen=True, tag="StopJobs.v1"):
    """O3: stop one or many jobs (queued ones at once, running ones through the launcher), and the jobs of
    arrays, all or some of their indices."""

    job_ids: list[str]
    arrays: list[ArraySelection] = msgspec.field(default_factory=list)


class DeleteJobs(_Request, frozen=True, tag="DeleteJobs.v1"):
    """O3: delete one or many ended jobs, and the jobs of arrays (all or some, every one ended)."""

    job_ids: list[str]
    arrays: list[ArraySelection] = msgspec.field(default_factory=list)


class ChangePriority(_Request, frozen=True, tag="ChangePriority.v1"):
    """S3: change the priority of a queued job (very-urgent: administrators only)."""

    job_id: str
    priority: Priority


class ChangeDuration(_Request, frozen=True, tag="ChangeDuration.v1"):
    """S11: change a job's duration limit (`30m`, `4h`, `2d`; None removes it), also while it runs."""

    job_id: str
    duration: str | None


class CloneJob(_Request, frozen=True, tag="CloneJob.v1"):
    """O1: create a job from another's spec with top-level fields replaced by `overrides`."""

    source_job_id: str
    job_id: str  # the new job's id, chosen by the client so a retry is idempotent
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)


class PredictJob(_Request, frozen=True, tag="PredictJob.v1"):
    """S6: would this spec start now, or where would it queue and until when? Creates nothing."""

    spec: JobSpec


class ExplainJob(_Request, frozen=True, tag="ExplainJob.v1"):
    """`trainyard why`: what a queued job waits for."""

    job_id: str
    at: PastInstant | None = None


class GetDevEnv(_Request, frozen=True, tag="GetDevEnv.v1"):
    """O4: a development environment spec derived from a job."""

    job_id: str


class GetJobHistory(_Request, frozen=True, tag="GetJobHistory.v1"):
    """O6: every service's events about one job, in order."""

    job_id: str


# A log page stays well under the NATS default max payload (1 MiB), whatever the caller asks for.
MAX_LOG_PAGE_CHUNKS = 500
MAX_LOG_PAGE_BYTES = 512 * 1024


class GetJobLogs(_Request, frozen=True, tag="GetJobLogs.v1"):
    """L9: one page of a job's log chunks (every rank, or one), in the order they were stored.

    `after` is a position in the log stream: the page holds chunks stored after it, so asking again
    with the reply's `next_after` goes on where the page ended (0: from the oldest chunk kept). A page
    holds at most `max_chunks` chunks and about `max_bytes` of them, but at least one when one is stored.
    """

    job_id: str
    rank: Annotated[int, Meta(ge=0)] | None = None
    after: Annotated[int, Meta(ge=0)] = 0
    max_chunks: Annotated[int, Meta(ge=1, le=MAX_LOG_PAGE_CHUNKS)] = 100
    max_bytes: Annotated[int, Meta(ge=1024, le=MAX_LOG_PAGE_BYTES)] = 256 * 1024


class GetJobUsage(_Request, frozen=True, tag="GetJobUsage.v1"):
    """L9: the latest resource sample of each node of the job's latest sampled attempt."""

    job_id: str


class SearchJobs(_Request, frozen=True, tag="SearchJobs.v1"):
    """O2: jobs the caller may see, matching every given filter (`name` is a case-insensitive part)."""

    name: str | None = None
    statuses: list[JobStatus] = msgspec.field(default_factory=list)
    creator: str | None = None
    algorithm: str | None = None  # an own algorithm
    favorite_algorithm: str | None = None
    flavor: str | None = None  # among the job's flavors
    output: str | None = None
    project: str | None = None
    limit: int = 200


class GetResources(_Request, frozen=True, tag="GetResources.v1"):
    """S7: the schedulable nodes for these flavors, with what is used and free on each."""

    flavors: list[str]
    at: PastInstant | None = None


class ListFlavors(_Request, frozen=True, tag="ListFlavors.v1"):
    """S8: flavors, optionally of one accelerator board model, with the boards queued jobs need."""

    board: str | None = None


class GetSettings(_Request, frozen=True, tag="GetSettings.v1"):
    pass


class ChangeSettings(_Request, frozen=True, tag="ChangeSettings.v1"):
    """Administrators only: replace the given settings, keep the others."""

    urgent_cap: int | None = None
    sharing_enabled: bool | None = None
    max_resumes_cap: int | None = None
    max_graceful_shutdown_seconds: int | None = None
    debug_retention: str | None = None
    cache_retention: str | None = None
    cache_high_percent: Annotated[float, Meta(gt=0, le=100)] | None = None
    cache_low_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    disk_high_percent: Annotated[float, Meta(gt=0, le=100)] | None = None
    disk_low_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    max_queued_jobs_per_user: int | None = None  # 0: no limit
    submit_rate: int | None = None  # jobs per second; 0: no limit
    submit_burst: Annotated[int, Meta(ge=1)] | None = None


class SetStorageAccess(_Request, frozen=True, tag="SetStorageAccess.v1"):
    """J2: register a resource of shared storage to the caller (or, for administrators, to `owner`),
    or change what the other members of `project` may do with it. Only its owner or an administrator
    may change a registered resource."""

    kind: StoredKind
    name: ResourceName
    project: ResourceName
    others: Access
    owner: str | None = None


class ListStorageAccess(_Request, frozen=True, tag="ListStorageAccess.v1"):
    kind: StoredKind | None = None


class WhoAmI(_Request, frozen=True, tag="WhoAmI.v1"):
    pass


class MarkComponent(_Request, frozen=True, tag="MarkComponent.v1"):
    """M2 drills: an administrator marks a node's component (`board:0`, `nic:eth0`, `runtime:storage`)
    faulty, or clears the mark with `faulty: false`."""

    node: str
    component: str
    faulty: bool = True
    reason: str = ""


class OpenTerminal(_Request, frozen=True, tag="OpenTerminal.v1"):
    """J15: open a debug session in a kept environment of a job (needs read-write access). Without
    `node`, the master's node; without `command`, an interactive shell.

    `session_id` (32 hex digits from a secure random source) is chosen by the client, so that it can
    listen to its own session's subjects before it asks, and to no one else's; without it the
    monitor makes one."""

    job_id: str
    node: str | None = None
    command: str | None = None
    columns: int = 80
    rows: int = 24
    session_id: Annotated[str, Meta(pattern="^[0-9a-f]{32}$")] | None = None


class ListJobs(_Request, frozen=True, tag="ListJobs.v1"):
    """Jobs, newest first. `group_arrays`: the jobs of arrays are left out of `jobs`, and each array with a
    job among those asked for is in `arrays`, as one object."""

    statuses: list[JobStatus] = msgspec.field(default_factory=list)
    project: str | None = None
    limit: int = 200
    group_arrays: bool = False
    at: PastInstant | None = None


class GetArray(_Request, frozen=True, tag="GetArray.v1"):
    """An array and its jobs in index order: up to `limit` of them, from the first index after `after`."""

    array_id: str
    after: int = -1
    limit: Annotated[int, Meta(ge=1, le=MAX_ARRAY_PAGE)] = MAX_ARRAY_PAGE
    at: PastInstant | None = None


class GetJob(_Request, frozen=True, tag="GetJob.v1"):
    job_id: str
    at: PastInstant | None = None


class ListNodes(_Request, frozen=True, tag="ListNodes.v1"):
    at: PastInstant | None = None


MAX_SIMULATED_NODES = 10_000  # nodes a what-if may add or remove per flavor


class SimulateHistory(_Request, frozen=True, tag="SimulateHistory.v1"):
    """`trainyard simulate` (administrators): the submissions recorded between `start` and `end` (None: now)
    replayed through the scheduler's own cycles in virtual time, each job running as long as it really ran, on the
    cluster changed by `add_nodes` (per flavor: copies of the largest node it applies to), `remove_nodes` (per
    flavor: nodes it applies to, the last by name first) and `depth` (the jobs a cycle looks at), beside what
    really happened."""

    start: PastInstant
    end: PastInstant | None = None
    add_nodes: dict[ResourceName, Annotated[int, Meta(ge=1, le=MAX_SIMULATED_NODES)]] = msgspec.field(
        default_factory=dict)
    remove_nodes: dict[ResourceName, Annotated[int, Meta(ge=1, le=MAX_SIMULATED_NODES)]] = msgspec.field(
        default_factory=dict)
    depth: Annotated[int, Meta(ge=1, le=100_000)] | None = None


class GetQueue(_Request, frozen=True, tag="GetQueue.v1"):
    """The first `limit` waiting jobs in the order the scheduler tries them (`JobList`, `queue_position` from 1;
    `waiting`: how many the caller may see in all), as they were `at` an instant (`trainyard at TIME queue`) or
    now."""

    at: PastInstant | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 200


MAX_ALERT_PAGE = 1000
MAX_ALERT_PAGE_BYTES = 512 * 1024  # well under NATS's default max payload, like a log page


class ListAlerts(_Request, frozen=True, tag="ListAlerts.v1"):
    """M7: alerts the caller may see, oldest first, raised after position `after` (0: from the first).

    `after` is a position in the monitor's event log: asking again with the reply's `next_after` goes on
    where the page ended. The monitor looks at no more than `limit` alerts per page and sends about
    `MAX_ALERT_PAGE_BYTES` of them at most, so a page of someone who may see few alerts can be short, even
    empty, while `more` says there are more to look at. Answered by the monitor.
    """

    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_ALERT_PAGE)] = 200


class GetQueueStatus(_Request, frozen=True, tag="GetQueueStatus.v1"):
    pass


MAX_AUTOSCALER_LOG_PAGE = 1000


PRELOAD_ID = r"^preload-[0-9a-f]{12}$"


class PreloadDataset(_Request, frozen=True, tag="PreloadDataset.v1"):
    """D2: copy dataset `name` (at `version`) into the caches of `nodes`, or of every node that can take a
    rank of `flavor`, ahead of the jobs that read it. `preload_id` (chosen by the client) makes a repeated
    request the same preload."""

    preload_id: Annotated[str, Meta(pattern=PRELOAD_ID)]
    name: ResourceName
    version: ResourceName | None = None
    nodes: Annotated[list[NodeName], Meta(max_length=1000)] = msgspec.field(default_factory=list)
    flavor: ResourceName | None = None


class GetRun(_Request, frozen=True, tag="GetRun.v1"):
    """R2: a job's run: its series (each name per task and rank) with their last, least and greatest
    values, its configuration and summary."""

    job_id: str


# Points in one page of a series: a page of points with the longest process labels and node names stays under
# NATS's default max payload (1 MiB), as tests/unit/test_run_charts.py checks.
MAX_SERIES_PAGE = 4_000


class GetSeries(_Request, frozen=True, tag="GetSeries.v1"):
    """R2: the points of series `name` of a job's run, of one `rank` (None: every rank), in the order they
    were logged, after position `after` in the run's stream (0: from the first), at most `limit` (or one
    agent's batch, when that holds more); asking again with the reply's `next_after` goes on."""

    job_id: str
    name: Annotated[str, Meta(max_length=128)]
    rank: Annotated[int, Meta(ge=0)] | None = None
    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_SERIES_PAGE)] = MAX_SERIES_PAGE


class ListCache(_Request, frozen=True, tag="ListCache.v1"):
    """D1, D2: the dataset caches of every node, or of `node`."""

    node: str | None = None


class GetAutoscalerLog(_Request, frozen=True, tag="GetAutoscalerLog.v1"):
    """A6: the autoscaler's own log (its instance events), oldest first, after position `after` in it (0: from
    its first kept entry). Asking again with the reply's `next_after` goes on where the page ended."""

    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_AUTOSCALER_LOG_PAGE)] = 200


# --- J10: training images (libs/contracts/images.py) -----------------------------------------------


class UploadImageChunk(_Request, frozen=True, tag="UploadImageChunk.v1"):
    """A piece of an archive being uploaded (administrators). Chunks come in order: `offset` is where this
    one begins; a chunk sent again after its answer was lost is answered as the first time."""

    upload_id: UploadId
    offset: Annotated[int, Meta(ge=0)]
    data: Annotated[bytes, Meta(min_length=1, max_length=MAX_CHUNK_BYTES)]


class RegisterImage(_Request, frozen=True, tag="RegisterImage.v1"):
    """Make an upload an image of the catalogue (administrators). `digest` is the whole archive's, as the
    client read it: an upload that differs is refused. `replace` gives an existing NAME:TAG a new archive."""

    name: ImageName
    tag: ImageTag
    upload_id: UploadId
    digest: Digest
    boards: Annotated[list[BoardName], Meta(min_length=1, max_length=64)]
    training: bool = True
    description: Annotated[str, Meta(max_length=MAX_DESCRIPTION)] = ""
    replace: bool = False


class ListImages(_Request, frozen=True, tag="ListImages.v1"):
    """The catalogue (everyone); with `ref`, that one image."""

    ref: Annotated[str, Meta(max_length=300)] | None = None


class MarkImage(_Request, frozen=True, tag="MarkImage.v1"):
    """Mark an image for training jobs, or take the mark away (administrators)."""

    ref: Annotated[str, Meta(max_length=300)]
    training: bool


class DeleteImage(_Request, frozen=True, tag="DeleteImage.v1"):
    """Take an image out of the catalogue (administrators). Jobs that were accepted with it keep it."""

    ref: Annotated[str, Meta(max_length=300)]


# --- replies ---------------------------------------------------------------------------------------


class _Reply(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every reply."""


ErrorCode = Literal["invalid-request", "invalid-spec", "not-found", "conflict", "invalid-state",
                    "unauthenticated", "forbidden", "over-cap", "unavailable", "internal"]


class CommandError(_Reply, frozen=True, tag="Error.v1"):
    """A refused request: `code` for programs, `message` and `hint` for people."""

    code: ErrorCode
    message: str
    hint: str | None = None
    errors: list[FieldError] = msgspec.field(default_factory=list)


class JobAccepted(_Reply, frozen=True, tag="JobAccepted.v1"):
    job_id: str
    status: JobStatus
    created: bool
    prediction: Prediction | None = None  # when asked for (`SubmitJob.predict`)


class InstanceView(Struct, frozen=True, kw_only=True):
    """One node of a job (L8): rank 0 is the master."""

    rank: int
    node: str
    master: bool
    state: Literal["pending", "running", "exited", "lost"]
    pid: int | None = None
    exit_code: int | None = None
    role: str = "worker"  # worker, ps (TensorFlow parameter server) or standby (MPI)


class JobView(Struct, frozen=True, kw_only=True):
    """What `trainyard list` and `show` print about a job."""

    job_id: str
    name: str
    project: str
    creator: str
    status: JobStatus
    priority: str
    mode: str
    nodes: int
    flavors: list[str]
    submitted_at: datetime
    flavor: str | None = None
    attempt: int = 0
    started_at: datetime | None = None
    ended_at: datetime | None = None
    reason: str | None = None
    exit_code: int | None = None
    output: str | None = None
    queue_position: int | None = None
    placement: list[Placement] = msgspec.field(default_factory=list)
    instances: list[InstanceView] = msgspec.field(default_factory=list)
    duration: str | None = None  # the current duration limit (S11)
    expires_at: datetime | None = None  # when a running job passes it (J16)
    dropped_flavors: list[str] = msgspec.field(default_factory=list)  # S5
    access: str = "none"  # J2: what others in the project may do (after the sharing switch)
    cloned_from: str | None = None
    prediction: Prediction | None = None  # S6: what was predicted when it was queued
    # S6: a waiting job's start as the scheduler expects it now (`show`, `list`), the same as `why` and `predict` tell:
    # likely `estimated_start`, latest `latest_start`, with the `reason`.
    expected: Prediction | None = None
    resumes: int = 0  # J12/M4: times it was moved after a fault and resumed from its checkpoint
    max_resumes: int | None = None  # the effective maximum (the spec's, within the administrator cap)
    restarts: int = 0  # J13/M5: times its failed command was restarted
    excluded_nodes: list[str] = msgspec.field(default_factory=list)  # nodes it was moved away from
    kept_until: datetime | None = None  # J15: its environments are kept for the debug terminal until then
    array: ArrayMember | None = None  # the array it belongs to, and its index there
    image: str | None = None  # J10: the image it runs in, NAME:TAG@digest


class ArrayView(Struct, frozen=True, kw_only=True):
    """An array as one object: what it was made from and how many of its jobs are in each state."""

    array_id: str
    name: str  # the spec's name, with `{index}` left in it
    project: str
    creator: str
    submitted_at: datetime
    size: int
    indices: str  # the array expression its indices make (`0-999`), or the sweep's points (`0-3`)
    sweep: list[SweepParameter] = msgspec.field(default_factory=list)
    max_running: int | None = None
    statuses: dict[str, int] = msgspec.field(default_factory=dict)  # JobStatus -> how many of its jobs

    @property
    def status(self) -> str:
        """queued (none started yet), running (some not ended), or ended."""
        if self.statuses.get("running"):
            return "running"
        if self.statuses.get("queued"):
            return "running" if sum(self.statuses.values()) > self.statuses["queued"] else "queued"
        return "ended"


class ArrayMemberView(Struct, frozen=True, kw_only=True):
    """One job of an array."""

    index: int
    job_id: str
    status: JobStatus
    started_at: datetime | None = None
    ended_at: datetime | None = None
    exit_code: int | None = None
    reason: str | None = None
    values: dict[str, str] = msgspec.field(default_factory=dict)  # its sweep point


class JobList(_Reply, frozen=True, tag="JobList.v1"):
    jobs: list[JobView]
    arrays: list[ArrayView] = msgspec.field(default_factory=list)
    waiting: int | None = None  # GetQueue: the waiting jobs the caller may see, in all


class ArrayAccepted(_Reply, frozen=True, tag="ArrayAccepted.v1"):
    array_id: str
    job_ids: list[str]  # in index order
    created: bool


class ArrayDetails(_Reply, frozen=True, tag="ArrayDetails.v1"):
    array: ArrayView
    jobs: list[ArrayMemberView]
    more: bool = False  # jobs after the last of `jobs`


class JobDetails(_Reply, frozen=True, tag="JobDetails.v1"):
    job: JobView
    spec: JobSpec


class NodeView(Struct, frozen=True, kw_only=True):
    info: NodeInfo
    # draining: the autoscaler is releasing it (A3); disk-full: its disk is under pressure (D1), see `problems`
    status: Literal["ready", "lost", "unhealthy", "draining", "disk-full"]
    used: Resources
    jobs: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)  # M2: why it is unhealthy


class NodeList(_Reply, frozen=True, tag="NodeList.v1"):
    nodes: list[NodeView]


class Done(_Reply, frozen=True, tag="Done.v1"):
    """A command that changed (or found already changed) the named jobs."""

    job_ids: list[str]
    message: str = ""


class JobSummary(Struct, frozen=True, kw_only=True):
    """One row of the search read model (O2)."""

    job_id: str
    name: str
    project: str
    creator: str
    status: JobStatus
    priority: str
    mode: str
    flavors: list[str]
    flavor: str | None = None
    algorithm: str | None = None
    algorithm_source: str | None = None  # private (own) or favorite
    output: str | None = None
    submitted_at: datetime
    ended_at: datetime | None = None


class SearchResults(_Reply, frozen=True, tag="SearchResults.v1"):
    jobs: list[JobSummary]


class PredictionReply(_Reply, frozen=True, tag="PredictionReply.v1"):
    prediction: Prediction


class PriorityWaits(Struct, frozen=True, kw_only=True):
    """How long the jobs of one priority waited (submit to start, seconds), really and in the simulation; None: no
    job of it started."""

    priority: str
    jobs: int
    real_p50: float | None = None
    real_p95: float | None = None
    simulated_p50: float | None = None
    simulated_p95: float | None = None


class FlavorUse(Struct, frozen=True, kw_only=True):
    """The share of the cluster's CPUs (of its boards, for a flavor with boards) the jobs of one flavor held over
    the window, really and in the simulation."""

    flavor: str
    real: float
    simulated: float


class MovedJob(Struct, frozen=True, kw_only=True):
    """A job whose simulated start differs from its real one (None: it did not start in the window)."""

    job_id: str
    name: str
    priority: str
    submitted_at: datetime
    real_start: datetime | None = None
    simulated_start: datetime | None = None


class SimulationPoint(Struct, frozen=True, kw_only=True):
    """The queue's length and the share of the cluster's CPUs held, at one instant, really and simulated."""

    at: datetime
    queued_real: int
    queued_simulated: int
    busy_real: float
    busy_simulated: float


class SimulationProgress(_Reply, frozen=True, tag="SimulationProgress.v1"):
    """How far a `SimulateHistory` has come, sent to the request's reply subject before its report (at most twice a
    second): the events folded to rebuild the window's start and end (`rebuilding`), then the share of the window
    played (`playing`, 0 to 1)."""

    stage: Literal["rebuilding", "playing"]
    events: int = 0
    played: Annotated[float, Meta(ge=0, le=1)] = 0.0


class SimulationReport(_Reply, frozen=True, tag="SimulationReport.v1"):
    """What `SimulateHistory` found: the jobs replayed, waits per priority, makespan, use per flavor, the jobs
    whose start moved most, and the queue and use over time; `notes` says what the replay left out."""

    start: datetime
    end: datetime
    jobs: int  # replayed: queued or running at `start`, or submitted in the window
    nodes_real: int
    nodes_simulated: int
    cycles: int
    waits: list[PriorityWaits]
    makespan_real_seconds: float | None = None  # from `start` to the last end of a replayed job
    makespan_simulated_seconds: float | None = None
    utilization: list[FlavorUse] = msgspec.field(default_factory=list)
    compared: int = 0  # jobs that started both really and in the simulation
    same_start: int = 0  # of those, within a second of each other
    start_difference_p50: float | None = None  # seconds, absolute
    start_difference_p95: float | None = None
    moved: list[MovedJob] = msgspec.field(default_factory=list)  # the most moved first
    series: list[SimulationPoint] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)


class WhyReply(_Reply, frozen=True, tag="WhyReply.v1"):
    report: WhyReport


class DevEnvSpec(_Reply, frozen=True, tag="DevEnvSpec.v1"):
    """O4: what a development environment needs to look like the job's node: image, size, mounts."""

    name: str
    project: str
    source_job_id: str
    image: str | None
    flavor: str
    mode: str
    mounts: list[Mount]
    env: dict[str, str]
    node_names: list[str] = msgspec.field(default_factory=list)
    pool: str | None = None
    driver_version: str | None = None
    command: str | None = None  # what the job ran, for reference


class JobHistory(_Reply, frozen=True, tag="JobHistory.v1"):
    events: list[EventEnvelope]


class LogPage(_Reply, frozen=True, tag="LogPage.v1"):
    """A page of `GetJobLogs`: chunks in stored order, and where the next page starts."""

    chunks: list[LogChunk]
    next_after: int  # the `after` of the next request
    more: bool  # further chunks were already stored when the page was read: ask again at once
    # The job had ended before the page was read, so once `more` is false its log is complete
    # (but for the closing notice of an agent that restarts later).
    ended: bool


class AlertPage(_Reply, frozen=True, tag="AlertPage.v1"):
    """A page of `ListAlerts`: envelopes whose event is an `AlertRaised`, oldest first, and where the next
    page starts (`next_after`); `more` is false once the page reached the newest alert."""

    alerts: list[EventEnvelope]
    next_after: int
    more: bool


class JobUsage(_Reply, frozen=True, tag="JobUsage.v1"):
    samples: list[UsageSample]  # by rank


class ResourceList(_Reply, frozen=True, tag="ResourceList.v1"):
    nodes: list[NodeResources]


class FlavorList(_Reply, frozen=True, tag="FlavorList.v1"):
    flavors: list[FlavorInfo]
    demand: list[BoardDemand]


class SettingsView(_Reply, frozen=True, tag="SettingsView.v1"):
    settings: AdminSettings


class StorageAccessList(_Reply, frozen=True, tag="StorageAccessList.v1"):
    """Registered resources of shared storage; whichever is not listed is open to everyone."""

    entries: list[StoredAccess]


class IdentityView(_Reply, frozen=True, tag="IdentityView.v1"):
    identity: Identity


class TerminalOpened(_Reply, frozen=True, tag="TerminalOpened.v1"):
    """J15: the session is open on `node`; talk to it on `subjects.session(node, owner, session_id, ...)`,
    `owner` being the caller's own NATS user (libs.natsroles.user_nats_name)."""

    session_id: str
    node: str
    rank: int
    attempt: int


ScaledInstanceState = Literal["requested", "booting", "ready", "draining"]


class ScaledInstance(Struct, frozen=True, kw_only=True):
    """One instance the autoscaler started and has not released (A6)."""

    name: str
    instance_type: str
    provider: str
    state: ScaledInstanceState  # requested: the provider not heard back yet; booting: its agent not registered yet
    since: datetime  # when it was asked for
    jobs: list[str]  # the waiting jobs it was asked for
    busy: bool = False  # a job holds its node now
    provider_id: str | None = None


class TypeCooldown(Struct, frozen=True, kw_only=True):
    """An instance type whose instances could not be started: not asked for again before `until`."""

    instance_type: str
    until: datetime
    failures: int


class SeriesView(Struct, frozen=True, kw_only=True):
    """One series of a run: a name logged by one rank of one task."""

    name: str
    task: int
    rank: int
    count: int
    last: float
    least: float
    greatest: float
    last_step: int | None = None
    last_at: datetime | None = None


class RankEnd(Struct, frozen=True, kw_only=True):
    """R1: one rank's process group of an attempt ended (`exit_code` None: given up on with its node)."""

    attempt: int
    task: int
    rank: int
    node: str
    exit_code: int | None
    ended_at: datetime


class ProcessView(Struct, frozen=True, kw_only=True):
    """R1: one process that logged into a run (`process`: its label), and when it finished its logging
    (`run.finish()`), if it did."""

    attempt: int
    task: int
    rank: int
    node: str
    process: str
    points: int
    finished_at: datetime | None = None


RunState = Literal["waiting", "running", "finished"]


class RunView(_Reply, frozen=True, tag="RunView.v1"):
    """R1, R2: a job's run: its life (it began with the job's first process, each later attempt continued
    it, its primary finished it), the ranks that ended, and what its processes logged."""

    job_id: str
    series: list[SeriesView]
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    summary: dict[str, Any] = msgspec.field(default_factory=dict)
    state: RunState = "waiting"
    began_at: datetime | None = None
    attempts: list[int] = msgspec.field(default_factory=list)
    finished_at: datetime | None = None
    finished_by: str | None = None
    ended: list[RankEnd] = msgspec.field(default_factory=list)
    processes: list[ProcessView] = msgspec.field(default_factory=list)


class SeriesPoint(Struct, frozen=True, kw_only=True, array_like=True):
    """One value of a series, with who logged it (the task, rank, attempt, process and node): `process` and its
    line number `seq` name the point, so a reader paging through a series takes a point the agent published
    twice (after a restart) once."""

    rank: int
    step: int | None
    value: float
    at: datetime
    task: int = 0
    attempt: int = 1
    process: str = ""
    seq: int = 0
    node: str = ""


class SeriesPage(_Reply, frozen=True, tag="SeriesPage.v1"):
    points: list[SeriesPoint]
    next_after: int
    more: bool = False


class PreloadAccepted(_Reply, frozen=True, tag="PreloadAccepted.v1"):
    """The preload is recorded: each of `nodes` is asked to copy `source`; `trainyard cache` shows it."""

    preload_id: str
    source: str
    nodes: list[str]


class NodeCache(Struct, frozen=True, kw_only=True):
    """One node's dataset cache as its agent last reported it: its entries, the copies under way and the
    preloads that failed lately."""

    node: str
    reported_at: datetime
    entries: list[CacheEntry]
    disk_bytes: int = 0
    used_bytes: int = 0
    copying: list[CopyUnderWay] = msgspec.field(default_factory=list)
    failures: list[StagingFailed] = msgspec.field(default_factory=list)


class CacheListing(_Reply, frozen=True, tag="CacheListing.v1"):
    nodes: list[NodeCache]


class AutoscalerLog(_Reply, frozen=True, tag="AutoscalerLog.v1"):
    """A page of the autoscaler's log: its events, oldest first; `more`: further entries are there already."""

    entries: list[EventEnvelope]
    next_after: int
    more: bool = False


class UploadReceived(_Reply, frozen=True, tag="UploadReceived.v1"):
    upload_id: str
    received_bytes: int  # the upload's length so far: where the next chunk begins


class ImageList(_Reply, frozen=True, tag="ImageList.v1"):
    images: list[ImageRecord] = msgspec.field(default_factory=list)


class QueueStatus(_Reply, frozen=True, tag="QueueStatus.v1"):
    """The autoscaler's view of demand: queued jobs and the nodes they ask for, per flavor; and its
    instances."""

    queued_jobs: int
    queued_by_flavor: dict[str, int]
    running_jobs: int
    instances: list[ScaledInstance] = msgspec.field(default_factory=list)
    cooldowns: list[TypeCooldown] = msgspec.field(default_factory=list)


Request = (SubmitJob | SubmitArray | GetArray | StopJobs | DeleteJobs | ChangePriority | ChangeDuration | CloneJob
           | PredictJob | ExplainJob | GetDevEnv | GetJobHistory | SearchJobs | GetResources | ListFlavors
           | GetSettings | ChangeSettings | WhoAmI | ListJobs | GetJob | ListNodes | GetQueue | SimulateHistory
           | GetQueueStatus
           | MarkComponent
           | OpenTerminal | SetStorageAccess | ListStorageAccess | GetJobLogs | GetJobUsage | ListAlerts
           | GetAutoscalerLog | ListCache | PreloadDataset | GetRun | GetSeries | UploadImageChunk | RegisterImage
           | ListImages | MarkImage | DeleteImage)
Reply = (CommandError | JobAccepted | ArrayAccepted | ArrayDetails | JobList | JobDetails | NodeList | Done
         | QueueStatus | SearchResults | PredictionReply | WhyReply | DevEnvSpec | JobHistory | ResourceList
         | FlavorList | SettingsView | IdentityView | TerminalOpened | StorageAccessList | LogPage | JobUsage
         | AlertPage | AutoscalerLog | CacheListing | PreloadAccepted | RunView | SeriesPage | SimulationReport
         | SimulationProgress | UploadReceived | ImageList)
