"""The autoscaler's view of demand and its log of decisions (SPEC A1).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.events import EventEnvelope
from libs.contracts.operations.base import ReplyMessage, RequestMessage, people_operation


class GetQueueStatus(RequestMessage, frozen=True, tag="GetQueueStatus.v1"):
    pass


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


class QueueStatus(ReplyMessage, frozen=True, tag="QueueStatus.v1"):
    """The autoscaler's view of demand: queued jobs and the nodes they ask for, per flavor; and its
    instances."""

    queued_jobs: int
    queued_by_flavor: dict[str, int]
    running_jobs: int
    instances: list[ScaledInstance] = msgspec.field(default_factory=list)
    cooldowns: list[TypeCooldown] = msgspec.field(default_factory=list)


MAX_AUTOSCALER_LOG_PAGE = 1000


class GetAutoscalerLog(RequestMessage, frozen=True, tag="GetAutoscalerLog.v1"):
    """A6: the autoscaler's own log (its instance events), oldest first, after position `after` in it (0: from
    its first kept entry). Asking again with the reply's `next_after` goes on where the page ended."""

    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_AUTOSCALER_LOG_PAGE)] = 200


class AutoscalerLog(ReplyMessage, frozen=True, tag="AutoscalerLog.v1"):
    """A page of the autoscaler's log: its events, oldest first; `more`: further entries are there already."""

    entries: list[EventEnvelope]
    next_after: int
    more: bool = False


# --- operations ------------------------------------------------------------------------------------

QUEUE_STATUS = people_operation(
    "queue-status", "trainyard.query.autoscaler.status", GetQueueStatus, QueueStatus, "autoscaler", changes_state=False,
    summary="Demand per flavor and the autoscaler's machines.")
AUTOSCALER_LOG = people_operation(
    "autoscaler-log", "trainyard.query.autoscaler.log", GetAutoscalerLog, AutoscalerLog, "autoscaler",
    changes_state=False,
    summary="A page of the autoscaler's decisions.")
