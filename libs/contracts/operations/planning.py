"""Predictions, explanations and what-if replays of the scheduler's plan (SPEC S6, S7, S8).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.jobspec import JobSpec, ResourceName
from libs.contracts.operations.base import PastInstant, ReplyMessage, RequestMessage, people_operation
from libs.contracts.scheduling import (
    Prediction,
    WhyReport,
)


class PredictJob(RequestMessage, frozen=True, tag="PredictJob.v1"):
    """S6: would this spec start now, or where would it queue and until when? Creates nothing."""

    spec: JobSpec


class PredictionReply(ReplyMessage, frozen=True, tag="PredictionReply.v1"):
    prediction: Prediction


class ExplainJob(RequestMessage, frozen=True, tag="ExplainJob.v1"):
    """`trainyard why`: what a queued job waits for."""

    job_id: str
    at: PastInstant | None = None


class WhyReply(ReplyMessage, frozen=True, tag="WhyReply.v1"):
    report: WhyReport


MAX_SIMULATED_NODES = 10_000  # nodes a what-if may add or remove per flavor


class SimulateHistory(RequestMessage, frozen=True, tag="SimulateHistory.v1"):
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


class SimulationProgress(ReplyMessage, frozen=True, tag="SimulationProgress.v1"):
    """How far a `SimulateHistory` has come, sent to the request's reply subject before its report (at most twice a
    second): the events folded to rebuild the window's start and end (`rebuilding`), then the share of the window
    played (`playing`, 0 to 1)."""

    stage: Literal["rebuilding", "playing"]
    events: int = 0
    played: Annotated[float, Meta(ge=0, le=1)] = 0.0


class SimulationReport(ReplyMessage, frozen=True, tag="SimulationReport.v1"):
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


# --- operations ------------------------------------------------------------------------------------

PREDICT_JOB = people_operation(
    "predict-job", "trainyard.query.jobs.predict", PredictJob, PredictionReply, "scheduler", changes_state=False,
    summary="When a job of this spec would start, without queueing it.")
EXPLAIN_JOB = people_operation(
    "explain-job", "trainyard.query.jobs.why", ExplainJob, WhyReply, "scheduler", changes_state=False,
    summary="Why a job waits, and what would start it sooner.")
SIMULATE = people_operation(
    "simulate", "trainyard.query.simulate", SimulateHistory, SimulationReport, "scheduler", changes_state=False,
    summary="Replay recorded history with other nodes or settings (administrators).", progress=SimulationProgress)
