"""The autoscaler service: follows the job queue and reports demand (A1, A6).

Provisioning instances comes with the cloud and local providers; what stands now is the demand
view it will act on, rebuilt from the event log on every start and answered on request.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.events import EventEnvelope
from libs.contracts.identity import Identity
from libs.contracts.messages import GetQueueStatus, QueueStatus
from libs.eventstore import Tracking
from libs.messaging.follower import StreamFollower
from libs.messaging.rpc import register_authenticated
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from services.autoscaler.state import DemandState

SERVICE = "autoscaler"
REPORT_SECONDS = 30.0
log = get_logger(__name__)


class Autoscaler:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.rt = runtime
        self.demand = DemandState()

    async def start(self) -> None:
        follower = StreamFollower(self.rt.js, self.rt.store, stream=subjects.EVENTS_STREAM,
                                  subject=subjects.events_of_service("scheduler"), consumer="scheduler-events",
                                  message_type=EventEnvelope, handle=self.on_job_event, reactions=False)
        await follower.start()
        register_authenticated(self.rt.broker, SERVICE, subjects.QUEUE_STATUS, GetQueueStatus, self.status,
                               secret=self.rt.settings.require_auth_secret())
        self.rt.spawn(self.report_loop(follower), "report")

    async def on_job_event(self, envelope: EventEnvelope, _: Msg, __: Tracking | None) -> bool:
        self.demand.apply(envelope)
        return False

    async def status(self, _: GetQueueStatus, __: Identity) -> QueueStatus:
        return QueueStatus(queued_jobs=len(self.demand.queued), queued_by_flavor=self.demand.queued_by_flavor(),
                           running_jobs=len(self.demand.running))

    async def report_loop(self, follower: StreamFollower) -> None:
        await follower.caught_up.wait()
        while True:
            log.info("autoscaler.queue_depth", queued=len(self.demand.queued),
                     by_flavor=self.demand.queued_by_flavor(), running=len(self.demand.running))
            await asyncio.sleep(REPORT_SECONDS)
