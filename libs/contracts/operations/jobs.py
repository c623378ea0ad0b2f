"""Jobs: submitting, cloning, stopping, deleting and changing them, and every view of them (SPEC J1–J9, X6).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.arrays import ArrayMember
from libs.contracts.events import EventEnvelope, Mount, Placement
from libs.contracts.jobspec import Access, JobSpec, Priority
from libs.contracts.operations.arrays import ArraySelection, ArrayView
from libs.contracts.operations.base import Done, JobStatus, PastInstant, ReplyMessage, RequestMessage, people_operation
from libs.contracts.scheduling import (
    Prediction,
)


class SubmitJob(RequestMessage, frozen=True, tag="SubmitJob.v1"):
    """Create a job. `job_id` is chosen by the client so that a retried submit is idempotent.

    `predict`: answer with the job's prediction (S6), planned before it joins the queue. Without it the
    prediction is planned after the job is accepted, together with those of other new jobs, and recorded
    a moment later (`trainyard show`)."""

    job_id: str
    spec: JobSpec
    predict: bool = False


class JobAccepted(ReplyMessage, frozen=True, tag="JobAccepted.v1"):
    job_id: str
    status: JobStatus
    created: bool
    prediction: Prediction | None = None  # when asked for (`SubmitJob.predict`)


class StopJobs(RequestMessage, frozen=True, tag="StopJobs.v1"):
    """O3: stop one or many jobs (queued ones at once, running ones through the launcher), and the jobs of
    arrays, all or some of their indices."""

    job_ids: list[str]
    arrays: list[ArraySelection] = msgspec.field(default_factory=list)


class DeleteJobs(RequestMessage, frozen=True, tag="DeleteJobs.v1"):
    """O3: delete one or many ended jobs, and the jobs of arrays (all or some, every one ended)."""

    job_ids: list[str]
    arrays: list[ArraySelection] = msgspec.field(default_factory=list)


class ChangePriority(RequestMessage, frozen=True, tag="ChangePriority.v1"):
    """S3: change the priority of a queued job (very-urgent: administrators only)."""

    job_id: str
    priority: Priority


class ChangeDuration(RequestMessage, frozen=True, tag="ChangeDuration.v1"):
    """S11: change a job's duration limit (`30m`, `4h`, `2d`; None removes it), also while it runs."""

    job_id: str
    duration: str | None


class CloneJob(RequestMessage, frozen=True, tag="CloneJob.v1"):
    """O1: create a job from another's spec with `overrides` applied in their order. A key is a top-level field,
    replaced whole, or a dotted path into a field that holds fields or a mapping (`checkpoint_resume.max_resumes`,
    `env.SEED`), which sets that entry and keeps the others."""

    source_job_id: str
    job_id: str  # the new job's id, chosen by the client so a retry is idempotent
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)


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
    # S6: a waiting job's start as the scheduler expects it (`show`, `list`), the same as `why` and `predict` tell:
    # likely `estimated_start`, latest `latest_start`, with the `reason`; as of its `predicted_at` (`show` answers
    # with the latest plan's at once).
    expected: Prediction | None = None
    resumes: int = 0  # J12/M4: times it was moved after a fault and resumed from its checkpoint
    max_resumes: int | None = None  # the effective maximum (the spec's, within the administrator cap)
    restarts: int = 0  # J13/M5: times its failed command was restarted
    excluded_nodes: list[str] = msgspec.field(default_factory=list)  # nodes it was moved away from
    kept_until: datetime | None = None  # J15: its environments are kept for the debug terminal until then
    array: ArrayMember | None = None  # the array it belongs to, and its index there
    image: str | None = None  # J10: the image it runs in, NAME:TAG@digest


class ListJobs(RequestMessage, frozen=True, tag="ListJobs.v1"):
    """Jobs, newest first. `group_arrays`: the jobs of arrays are left out of `jobs`, and each array with a
    job among those asked for is in `arrays`, as one object."""

    statuses: list[JobStatus] = msgspec.field(default_factory=list)
    project: str | None = None
    limit: int = 200
    group_arrays: bool = False
    at: PastInstant | None = None


class JobList(ReplyMessage, frozen=True, tag="JobList.v1"):
    jobs: list[JobView]
    arrays: list[ArrayView] = msgspec.field(default_factory=list)
    waiting: int | None = None  # GetQueue: the waiting jobs the caller may see, in all


class GetJob(RequestMessage, frozen=True, tag="GetJob.v1"):
    job_id: str
    at: PastInstant | None = None


class JobDetails(ReplyMessage, frozen=True, tag="JobDetails.v1"):
    job: JobView
    spec: JobSpec


class GetQueue(RequestMessage, frozen=True, tag="GetQueue.v1"):
    """The first `limit` waiting jobs in the order the scheduler tries them (`JobList`, `queue_position` from 1;
    `waiting`: how many the caller may see in all), as they were `at` an instant (`trainyard at TIME queue`) or
    now."""

    at: PastInstant | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 200


class SearchJobs(RequestMessage, frozen=True, tag="SearchJobs.v1"):
    """O2: jobs the caller may see, matching every given filter (`name` is a case-insensitive part), newest
    first: a page of at most `limit` of them after skipping the first `offset`."""

    name: str | None = None
    statuses: list[JobStatus] = msgspec.field(default_factory=list)
    creator: str | None = None
    algorithm: str | None = None  # an own algorithm
    favorite_algorithm: str | None = None
    flavor: str | None = None  # among the job's flavors
    output: str | None = None
    project: str | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 200
    offset: Annotated[int, Meta(ge=0, le=1_000_000)] = 0


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
    nodes: int | None = None  # the node count its spec asks for; None when the search cannot tell
    master: str | None = None  # the node of rank 0 while it runs
    access: Access = "none"  # J2: what others in the project may do (after the sharing switch)


class SearchResults(ReplyMessage, frozen=True, tag="SearchResults.v1"):
    """One page of a search; `total`: how many jobs match in all (null from a scheduler that does not count them)."""

    jobs: list[JobSummary]
    total: int | None = None


# A page of a job's history stays well under the NATS default max payload (1 MiB): a job of 1,024 nodes records
# some 1.1 KiB of events per node and attempt.
MAX_HISTORY_PAGE_BYTES = 512 * 1024


class GetJobHistory(RequestMessage, frozen=True, tag="GetJobHistory.v1"):
    """O6: every service's events about one job, in order: a page of them from `start` (how many to skip: the
    previous page's `next`)."""

    job_id: str
    start: Annotated[int, Meta(ge=0)] = 0


class JobHistory(ReplyMessage, frozen=True, tag="JobHistory.v1"):
    events: list[EventEnvelope]
    next: int | None = None  # where the next page starts; None: this page ends the history


def history_page(events: list[EventEnvelope], start: int, max_bytes: int = MAX_HISTORY_PAGE_BYTES) -> JobHistory:
    """The events of a history from `start` that fit `max_bytes` as JSON (at least one, whatever its size: no
    event is larger than one event may be), and where the next page starts."""
    page: list[EventEnvelope] = []
    size = 64  # the reply's own fields
    for envelope in events[start:]:
        size += len(msgspec.json.encode(envelope)) + 1  # and the comma before the next
        if page and size > max_bytes:
            return JobHistory(events=page, next=start + len(page))
        page.append(envelope)
    return JobHistory(events=page)


# A log page stays well under the NATS default max payload (1 MiB), whatever the caller asks for.
MAX_LOG_PAGE_CHUNKS = 500
MAX_LOG_PAGE_BYTES = 512 * 1024


class GetJobLogs(RequestMessage, frozen=True, tag="GetJobLogs.v1"):
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


class ChunksOnce:
    """Passes each chunk of a log once while its pages are read. An agent ships a rank's chunks in order and ships
    again, after a restart, what it did not know was stored; the stream drops the repeat within its duplicate
    window (two minutes), and one shipped again later (a node down for longer) is stored a second time, after the
    first. It is known by its number: no larger than one already passed from the same rank's node."""

    def __init__(self) -> None:
        self._taken: dict[tuple[int, int, int, str], int] = {}  # each rank's node's last chunk number passed

    def first_time(self, chunk: LogChunk) -> bool:
        if chunk.seq < 0:  # an agent's notice, not numbered
            return True
        key = (chunk.attempt, chunk.task, chunk.rank, chunk.node)
        if chunk.seq <= self._taken.get(key, -1):
            return False
        self._taken[key] = chunk.seq
        return True

    def fresh(self, chunks: Iterable[LogChunk]) -> list[LogChunk]:
        return [chunk for chunk in chunks if self.first_time(chunk)]


class LogPage(ReplyMessage, frozen=True, tag="LogPage.v1"):
    """A page of `GetJobLogs`: chunks in stored order, and where the next page starts."""

    chunks: list[LogChunk]
    next_after: int  # the `after` of the next request
    more: bool  # further chunks were already stored when the page was read: ask again at once
    # The job had ended before the page was read, so once `more` is false its log is complete
    # (but for the closing notice of an agent that restarts later).
    ended: bool


class GetJobUsage(RequestMessage, frozen=True, tag="GetJobUsage.v1"):
    """L9: the latest resource sample of each node of the job's latest sampled attempt."""

    job_id: str


class JobUsage(ReplyMessage, frozen=True, tag="JobUsage.v1"):
    samples: list[UsageSample]  # by rank


class GetDevEnv(RequestMessage, frozen=True, tag="GetDevEnv.v1"):
    """O4: a development environment spec derived from a job."""

    job_id: str


class DevEnvSpec(ReplyMessage, frozen=True, tag="DevEnvSpec.v1"):
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


# --- operations ------------------------------------------------------------------------------------

SUBMIT_JOB = people_operation(
    "submit-job", "trainyard.cmd.jobs.submit", SubmitJob, JobAccepted, "scheduler", changes_state=True,
    summary="Queue a new job (or only predict its start).")
CLONE_JOB = people_operation(
    "clone-job", "trainyard.cmd.jobs.clone", CloneJob, JobAccepted, "scheduler", changes_state=True,
    summary="Queue a copy of a job, with some fields changed.")
STOP_JOBS = people_operation(
    "stop-jobs", "trainyard.cmd.jobs.stop", StopJobs, Done, "scheduler", changes_state=True,
    summary="Stop jobs and array members.")
DELETE_JOBS = people_operation(
    "delete-jobs", "trainyard.cmd.jobs.delete", DeleteJobs, Done, "scheduler", changes_state=True,
    summary="Delete ended jobs from the listings.")
CHANGE_PRIORITY = people_operation(
    "change-priority", "trainyard.cmd.jobs.priority", ChangePriority, Done, "scheduler", changes_state=True,
    summary="Change a queued job's priority.")
CHANGE_DURATION = people_operation(
    "change-duration", "trainyard.cmd.jobs.duration", ChangeDuration, Done, "scheduler", changes_state=True,
    summary="Change a job's time limit.")
LIST_JOBS = people_operation(
    "list-jobs", "trainyard.query.jobs.list", ListJobs, JobList, "scheduler", changes_state=False,
    summary="List jobs, by status and project.")
GET_JOB = people_operation(
    "get-job", "trainyard.query.jobs.get", GetJob, JobDetails, "scheduler", changes_state=False,
    summary="One job: its spec, status, nodes and attempts.")
GET_QUEUE = people_operation(
    "get-queue", "trainyard.query.jobs.queue", GetQueue, JobList, "scheduler", changes_state=False,
    summary="The waiting jobs in the order they will start.")
SEARCH_JOBS = people_operation(
    "search-jobs", "trainyard.query.jobs.search", SearchJobs, SearchResults, "scheduler", changes_state=False,
    summary="Find jobs by name, status, user, project or time.")
JOB_HISTORY = people_operation(
    "job-history", "trainyard.query.jobs.history", GetJobHistory, JobHistory, "scheduler", changes_state=False,
    summary="Every recorded event of one job, in pages of at most 512 KiB from `start` (each page says where the "
            "next starts).")
JOB_LOGS = people_operation(
    "job-logs", "trainyard.query.jobs.logs", GetJobLogs, LogPage, "scheduler", changes_state=False,
    summary="A page of a job's logs.")
JOB_USAGE = people_operation(
    "job-usage", "trainyard.query.jobs.usage", GetJobUsage, JobUsage, "scheduler", changes_state=False,
    summary="The latest resource usage of a running job's nodes.")
GET_DEV_ENV = people_operation(
    "get-dev-env", "trainyard.query.jobs.devenv", GetDevEnv, DevEnvSpec, "scheduler", changes_state=False,
    summary="What a development environment of a job needs.")
