"""A job's run (SPEC R1, R2): the metrics every process of a job logs into one run.

Inside the job, `trainyard.run` (a module of the standard library alone) sends points to its node's agent
over a local socket, one JSON object a line (`RUN_LINE_TYPES`). The agent numbers nothing itself: each
process numbers its points (`seq`, from 1, per process), so a point sent again after a lost connection
is the same point; the agent batches what it receives into `MetricBatch` messages on JetStream, named by
the job, attempt, task, rank and process, and acknowledges the highest number it has published.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

RUN_SOCKET_VARIABLE = "TRAINYARD_RUN_SOCKET"  # where a job's processes find their node's run socket
METRIC_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_./:-]{0,127}\Z"  # `loss`, `eval/acc`, `lr:group0`
PROCESS_LABEL = r"^[A-Za-z0-9_.-]{1,64}\Z"
MAX_POINTS_PER_BATCH = 1000
MAX_VALUES_PER_LINE = 256
MAX_RUN_LINE_BYTES = 64 * 1024  # one line from the job: a few hundred scalars at most
MetricName = Annotated[str, Meta(pattern=METRIC_NAME)]
ProcessLabel = Annotated[str, Meta(pattern=PROCESS_LABEL)]
Scalar = float | int | bool | Annotated[str, Meta(max_length=1024)]


class MetricPoint(Struct, frozen=True, kw_only=True, array_like=True):
    """One value of one series: `step` as the job numbered it (None: not numbered), `at` when it was
    logged, `seq` its number among what its process logged."""

    seq: Annotated[int, Meta(ge=1)]
    name: MetricName
    value: float
    at: datetime
    step: Annotated[int, Meta(ge=0)] | None = None


class MetricBatch(Struct, frozen=True, kw_only=True, tag_field="type", tag="MetricBatch.v1"):
    """Points one process of a job logged, as its node's agent publishes them (in `seq` order), with who
    logged them; `config` and `summary` are what it set of the run's configuration and summary."""

    job_id: str
    attempt: Annotated[int, Meta(ge=1)]
    task: Annotated[int, Meta(ge=0)]
    rank: Annotated[int, Meta(ge=0)]
    node: str
    process: ProcessLabel
    points: Annotated[list[MetricPoint], Meta(max_length=MAX_POINTS_PER_BATCH)] = msgspec.field(default_factory=list)
    config: Annotated[dict[MetricName, Scalar], Meta(max_length=256)] = msgspec.field(default_factory=dict)
    summary: Annotated[dict[MetricName, Scalar], Meta(max_length=256)] = msgspec.field(default_factory=dict)
    finished_at: datetime | None = None  # the process finished its logging (`run.finish()`) with this batch


# --- the lines between the job's processes and their node's agent ------------------------------------------


class LoggedLine(Struct, frozen=True, kw_only=True, tag_field="type", tag="log"):
    """From the job: points of one `run.log` call (and of the calls before it the agent did not take)."""

    process: ProcessLabel
    seq: Annotated[int, Meta(ge=1)]  # the first point's; the others follow it
    at: datetime
    values: Annotated[dict[MetricName, float], Meta(max_length=MAX_VALUES_PER_LINE)]
    step: Annotated[int, Meta(ge=0)] | None = None


class SetLine(Struct, frozen=True, kw_only=True, tag_field="type", tag="set"):
    """From the job: `run.config(...)` or `run.summary(...)`."""

    process: ProcessLabel
    seq: Annotated[int, Meta(ge=1)]
    what: Annotated[str, Meta(pattern=r"^(config|summary)\Z")]
    values: Annotated[dict[MetricName, Scalar], Meta(max_length=MAX_VALUES_PER_LINE)]


class EndLine(Struct, frozen=True, kw_only=True, tag_field="type", tag="end"):
    """From the job: `run.finish()`: this process logs no more. Only this process's end: the run goes on
    until its primary finishes it."""

    process: ProcessLabel
    seq: Annotated[int, Meta(ge=1)]
    at: datetime


class AckLine(Struct, frozen=True, kw_only=True, tag_field="type", tag="ack"):
    """To the job: every line of `process` up to `seq` is published (kept by JetStream)."""

    process: ProcessLabel
    seq: int


RunLine = LoggedLine | SetLine | EndLine
