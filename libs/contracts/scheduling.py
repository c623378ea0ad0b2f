"""What the scheduler explains and predicts (SPEC S6, S7, S8, S2, J2 settings, O4).

These structures appear both in replies and, for predictions, in the job's events: a prediction made
when a job is submitted is recorded so that its accuracy can be measured later.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.cluster import Flavor
from libs.contracts.jobspec import Access, ResourceName


class Prediction(Struct, frozen=True, kw_only=True):
    """S6: would a job start now, and if not, where it would wait and when it would likely start.

    `estimated_start` is the likely start, going by how long similar jobs really ran; `latest_start`
    the start planned as if every job ran to its duration limit (not a bound: jobs behind may still
    be backfilled ahead of it, and later jobs of a higher priority go first). Either
    is None when it cannot be bounded: the job waits for running jobs that have no duration limit, or
    it fits on no node of the cluster at all (`reason` says which).
    """

    starts_now: bool
    flavor: str | None = None  # the flavor it starts with now, or is expected to start with
    # One entry per rank: where it starts now, or where it is planned to start when it waits.
    nodes: list[str] = msgspec.field(default_factory=list)
    node_count: int = 0  # an elastic job may start on fewer nodes than it asks for
    position: int | None = None  # 1-based place in the queue when it queues
    jobs_ahead: int = 0
    estimated_start: datetime | None = None
    predicted_at: datetime
    reason: str = ""
    latest_start: datetime | None = None


class NodeShortage(Struct, frozen=True, kw_only=True):
    """Why one eligible node cannot take a rank of the job now."""

    node: str
    missing: list[str]  # e.g. "cpus: 2 free, 4 needed"
    held_by: list[str] = msgspec.field(default_factory=list)  # running jobs on the node


class FlavorWait(Struct, frozen=True, kw_only=True):
    """What one of the job's flavors is short of."""

    flavor: str
    eligible_nodes: int  # nodes the job may use at all with this flavor (S9)
    fitting_nodes: int  # of those, nodes where one rank fits now
    needed_nodes: int
    shortages: list[NodeShortage] = msgspec.field(default_factory=list)
    note: str = ""  # e.g. "no node has board A100", "pinned to gpu-1, gpu-2"


class WhyReport(Struct, frozen=True, kw_only=True):
    """`trainyard why JOB`: what a queued job waits for (resources, nodes, jobs ahead)."""

    job_id: str
    status: str
    position: int | None = None
    jobs_ahead: list[str] = msgspec.field(default_factory=list)  # the first few, in start order
    jobs_ahead_count: int = 0
    head: bool = False  # first in line: resources are reserved for it
    reserved_start: datetime | None = None
    reserved_nodes: list[str] = msgspec.field(default_factory=list)
    flavors: list[FlavorWait] = msgspec.field(default_factory=list)
    summary: list[str] = msgspec.field(default_factory=list)  # the explanation in sentences


NonNegative = Annotated[int, Meta(ge=0)]


class AdminSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Platform settings only administrators change; each change is an event (SettingsChanged)."""

    urgent_cap: NonNegative = 5  # S2: a user's running + queued urgent jobs per project
    sharing_enabled: bool = True  # J2: off forces every job's access for others to "none"
    max_resumes_cap: NonNegative = 10  # J12
    max_graceful_shutdown_seconds: NonNegative = 600  # J12
    debug_retention: str = "4h"  # J15
    # An ended job leaves the services' state in memory this long after its end (JobArchived); its history stays
    # in the log and the search read model. Slurm's MinJobAge keeps 300 s; a week leaves a job's page live for
    # its users' next look.
    job_retention: str = "7d"
    # D1, D2: nodes' dataset caches: an unused entry is kept this long; above `cache_high_percent` of its
    # disk a cache evicts its least recently used entries down to `cache_low_percent`.
    cache_retention: str = "7d"
    cache_high_percent: Annotated[float, Meta(gt=0, le=100)] = 50.0
    cache_low_percent: Annotated[float, Meta(ge=0, le=100)] = 40.0
    # D1: a node whose disk is fuller than this takes no new work (after its cache made what room it can),
    # and takes work again only at or below the low threshold.
    disk_high_percent: Annotated[float, Meta(gt=0, le=100)] = 90.0
    disk_low_percent: Annotated[float, Meta(ge=0, le=100)] = 85.0
    # Per user, every project together (services/scheduler/domain/limits.py); 0 is no limit. Queued jobs are capped as
    # Slurm's MaxSubmitJobs caps an association's; 10,000 is Slurm's default MaxJobCount, and lets one array of
    # the largest size (MAX_ARRAY_JOBS) into an empty queue. Submissions come out of a token bucket of
    # `submit_burst` that refills `submit_rate` jobs per second: an array of N jobs counts N against both.
    max_queued_jobs_per_user: NonNegative = 10_000
    submit_rate: NonNegative = 100
    submit_burst: Annotated[int, Meta(ge=1)] = 10_000


StoredKind = Literal["algorithm", "dataset", "annotation-dataset", "model", "volume", "output"]
STORAGE_FOLDERS: dict[StoredKind, str] = {  # where each kind lives in shared storage (libs/storage.py)
    "algorithm": "algorithms", "dataset": "datasets", "annotation-dataset": "annotations", "model": "models",
    "volume": "volumes", "output": "outputs",
}


class StoredAccess(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """J2: who owns a resource of shared storage (every version of it), and what the other members
    of its project may do with it. Resources nobody registered are open to everyone."""

    kind: StoredKind
    name: ResourceName
    owner: str
    project: ResourceName
    others: Access = "none"


class BoardUsage(Struct, frozen=True, kw_only=True):
    """S7: `1(1):app-name`: physical boards, virtual boards, and the application holding them."""

    physical: int
    virtual: int
    application: str
    job_id: str

    def __str__(self) -> str:
        return f"{self.physical}({self.virtual}):{self.application}"


FlavorFit = Literal["idle", "tight"]


class NodeResources(Struct, frozen=True, kw_only=True):
    """S7: one schedulable node as `trainyard resources --flavor F` shows it."""

    name: str
    status: dict[str, FlavorFit]  # per asked flavor: idle (fits in what is free) or tight
    os: str
    kernel: str
    cpus_used: float
    cpus_total: float
    memory_mib_used: int
    memory_mib_total: int
    accelerators_used: int
    accelerators_total: int
    board: str | None = None
    driver_version: str | None = None
    flavors: list[str] = msgspec.field(default_factory=list)  # every flavor that applies to the node
    usage: list[BoardUsage] = msgspec.field(default_factory=list)


class BoardDemand(Struct, frozen=True, kw_only=True):
    """S8: the boards of one model that queued jobs ask for."""

    board: str
    boards_needed: int
    queued_jobs: int


class FlavorInfo(Struct, frozen=True, kw_only=True):
    flavor: Flavor
    schedulable_nodes: int  # nodes this flavor can run on (board and size)
