"""The autoscaler service: follows the job queue and reports demand (A1, A6).

Provisioning instances comes with the cloud and local providers; what stands now is the demand
view it will act on, rebuilt by replaying the scheduler's events on every start and answered on request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from libs.contracts import subjects
from libs.contracts.events import EventEnvelope
from libs.contracts.identity import Identity
from libs.contracts.messages import GetQueueStatus, QueueStatus
from libs.eventsourced import EventSourcedService, Loop, Upstream
from libs.messaging.rpc import register_authenticated
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from services.autoscaler.state import DemandState

REPORT_SECONDS = 30.0
log = get_logger(__name__)


class Autoscaler(EventSourcedService):
    name = "autoscaler"

    def __init__(self, runtime: ServiceRuntime) -> None:
        super().__init__(runtime)
        self.demand = DemandState()

    # --- state, upstreams, handlers, loops -------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        """It records no events of its own yet."""

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of_service("scheduler"),
                         consumer="scheduler-events", message_type=EventEnvelope, fold=self.demand.apply,
                         reactions=False)]

    def handlers(self) -> None:
        register_authenticated(self.rt.broker, self.name, subjects.QUEUE_STATUS, GetQueueStatus, self.status,
                               secret=self.rt.settings.require_auth_secret())

    def loops(self) -> Mapping[str, Loop]:
        return {"report": self.report_loop}

    # --- handlers and loops ---------------------------------------------------------------------------

    async def status(self, _: GetQueueStatus, __: Identity) -> QueueStatus:
        return QueueStatus(queued_jobs=len(self.demand.queued), queued_by_flavor=self.demand.queued_by_flavor(),
                           running_jobs=len(self.demand.running))

    async def report_loop(self) -> None:
        await self.caught_up()
        while True:
            log.info("autoscaler.queue_depth", queued=len(self.demand.queued),
                     by_flavor=self.demand.queued_by_flavor(), running=len(self.demand.running))
            await asyncio.sleep(REPORT_SECONDS)
