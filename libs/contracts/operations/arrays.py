"""Job arrays: submitting an array (indices or a parameter sweep) and reading its members (SPEC J11).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from libs.contracts.arrays import MAX_EXPRESSION_LENGTH, MAX_SWEEP_PARAMETERS, SweepParameter
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.base import JobStatus, PastInstant, ReplyMessage, RequestMessage, people_operation

MAX_ARRAY_PAGE = 2_000  # jobs of an array in one answer, well within one NATS message


class SubmitArray(RequestMessage, frozen=True, tag="SubmitArray.v1"):
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


class ArrayAccepted(ReplyMessage, frozen=True, tag="ArrayAccepted.v1"):
    array_id: str
    job_ids: list[str]  # in index order
    created: bool


class GetArray(RequestMessage, frozen=True, tag="GetArray.v1"):
    """An array and its jobs in index order: up to `limit` of them, from the first index after `after`."""

    array_id: str
    after: int = -1
    limit: Annotated[int, Meta(ge=1, le=MAX_ARRAY_PAGE)] = MAX_ARRAY_PAGE
    at: PastInstant | None = None


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


class ArrayDetails(ReplyMessage, frozen=True, tag="ArrayDetails.v1"):
    array: ArrayView
    jobs: list[ArrayMemberView]
    more: bool = False  # jobs after the last of `jobs`


# --- operations ------------------------------------------------------------------------------------

SUBMIT_ARRAY = people_operation(
    "submit-array", "trainyard.cmd.arrays.submit", SubmitArray, ArrayAccepted, "scheduler", changes_state=True,
    summary="Queue an array of jobs (indices or a parameter sweep).")
GET_ARRAY = people_operation(
    "get-array", "trainyard.query.arrays.get", GetArray, ArrayDetails, "scheduler", changes_state=False,
    summary="An array and a page of its members.")
