"""Commands, queries and their typed replies (NATS request/reply, SPEC X6).

Requests forbid unknown fields: a client sending a field the service does not know gets a clear
error instead of having it ignored. Every reply is either the expected type or `CommandError`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec
from msgspec import Struct

from libs.contracts.cluster import NodeInfo, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import FieldError, JobSpec

JobStatus = Literal["queued", "running", "succeeded", "failed", "stopped", "expired"]
JOB_STATUSES: tuple[JobStatus, ...] = ("queued", "running", "succeeded", "failed", "stopped", "expired")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "expired"})


class _Request(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every command and query."""


class SubmitJob(_Request, frozen=True, tag="SubmitJob.v1"):
    """Create a job. `job_id` is chosen by the client so that a retried submit is idempotent."""

    job_id: str
    spec: JobSpec
    user: str


class StopJobs(_Request, frozen=True, tag="StopJobs.v1"):
    job_ids: list[str]
    user: str


class DeleteJobs(_Request, frozen=True, tag="DeleteJobs.v1"):
    job_ids: list[str]
    user: str


class ListJobs(_Request, frozen=True, tag="ListJobs.v1"):
    statuses: list[JobStatus] = msgspec.field(default_factory=list)
    project: str | None = None
    limit: int = 200


class GetJob(_Request, frozen=True, tag="GetJob.v1"):
    job_id: str


class ListNodes(_Request, frozen=True, tag="ListNodes.v1"):
    pass


class GetQueueStatus(_Request, frozen=True, tag="GetQueueStatus.v1"):
    pass


# --- replies ---------------------------------------------------------------------------------------


class _Reply(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every reply."""


ErrorCode = Literal["invalid-request", "invalid-spec", "not-found", "conflict", "invalid-state",
                    "unavailable", "internal"]


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


class JobList(_Reply, frozen=True, tag="JobList.v1"):
    jobs: list[JobView]


class JobDetails(_Reply, frozen=True, tag="JobDetails.v1"):
    job: JobView
    spec: JobSpec


class NodeView(Struct, frozen=True, kw_only=True):
    info: NodeInfo
    status: Literal["ready", "lost"]
    used: Resources
    jobs: list[str] = msgspec.field(default_factory=list)


class NodeList(_Reply, frozen=True, tag="NodeList.v1"):
    nodes: list[NodeView]


class Done(_Reply, frozen=True, tag="Done.v1"):
    """A command that changed (or found already changed) the named jobs."""

    job_ids: list[str]
    message: str = ""


class QueueStatus(_Reply, frozen=True, tag="QueueStatus.v1"):
    """The autoscaler's view of demand: queued jobs and the nodes they ask for, per flavor."""

    queued_jobs: int
    queued_by_flavor: dict[str, int]
    running_jobs: int


Request = SubmitJob | StopJobs | DeleteJobs | ListJobs | GetJob | ListNodes | GetQueueStatus
Reply = CommandError | JobAccepted | JobList | JobDetails | NodeList | Done | QueueStatus
