"""The requests the autoscaler answers (A6): the demand view with its instances, and its own log.

Both are read from what the autoscaler holds in memory, without its lock (nothing here awaits between the
reads); the jobs an instance was asked for are shown only as far as the caller may see them (J2).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec

from libs.contracts.events import EventEnvelope, InstanceRequested
from libs.contracts.identity import Identity
from libs.contracts.operations.autoscaler import (
    AUTOSCALER_LOG,
    QUEUE_STATUS,
    AutoscalerLog,
    GetAutoscalerLog,
    GetQueueStatus,
    QueueStatus,
    TypeCooldown,
)
from libs.messaging.responder import Route
from services.autoscaler.state import AutoscalerState


class AutoscalerQueries:
    def __init__(self, state: AutoscalerState, history: Sequence[EventEnvelope]) -> None:
        self.state = state
        self.history = history  # its own log, newest last, as far as it is kept

    def routes(self) -> list[Route]:
        return [(QUEUE_STATUS, self.status), (AUTOSCALER_LOG, self.log_page)]

    async def status(self, _: GetQueueStatus, identity: Identity) -> QueueStatus:
        shown = self.state.viewable_jobs(identity)
        instances = [msgspec.structs.replace(i, jobs=[j for j in i.jobs if j in shown])
                     for i in self.state.instance_views()]
        now = datetime.now(UTC)
        cooldowns = [TypeCooldown(instance_type=kind, until=c.until, failures=c.failures)
                     for kind, c in sorted(self.state.cooldowns.items()) if c.until > now]
        return QueueStatus(queued_jobs=len(self.state.queued), queued_by_flavor=self.state.queued_by_flavor(),
                           running_jobs=len(self.state.running), instances=instances, cooldowns=cooldowns)

    async def log_page(self, request: GetAutoscalerLog, identity: Identity) -> AutoscalerLog:
        """A6: its own log, oldest first; the jobs an instance was asked for only as far as the caller may see
        them (J2)."""
        newer = [e for e in self.history if e.position > request.after]
        page = newer[:request.limit]
        shown = self.state.viewable_jobs(identity)
        entries = [msgspec.structs.replace(e, event=msgspec.structs.replace(
            e.event, jobs=[j for j in e.event.jobs if j in shown])) if isinstance(e.event, InstanceRequested) else e
            for e in page]
        return AutoscalerLog(entries=entries, next_after=page[-1].position if page else request.after,
                             more=len(newer) > len(page))
