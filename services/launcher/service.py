"""The launcher service: turns admissions into processes on node agents and reports how they end.

It follows the scheduler's job events (admissions and stops) and the agents' process reports (each taken only
from the node it names, about a process planned there; anything else is set aside, rules.report_refusal). What
it decides (rules.py) is recorded first (LaunchPlanned, NodeProcessStarted, ...); talking to agents
happens after, in the dispatcher (dispatcher.py), which re-sends until the agents confirm.

A job the scheduler archives leaves the state once its launch has settled (state.py), and with it the version of its
launch and what the dispatcher kept of its requests: nothing is kept per job once it is archived.

It starts from the latest snapshot of its state (libs.skeleton.snapshots): the launches and the jobs not yet
archived, with where it stood in its log, the scheduler's events and the agents' reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import ClassVar, Self

from libs.contracts import subjects
from libs.contracts.agent import ProcessReport
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import EventEnvelope
from libs.natsroles import AGENT_REPORTS_CONSUMER, events_consumer
from libs.skeleton.eventsourced import EventSourcedService, Loop, Pacer, Upstream
from libs.skeleton.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from services.launcher.dispatcher import Dispatcher
from services.launcher.rules import LAUNCH, record_report, report_refusal
from services.launcher.state import LauncherState, decoded

log = get_logger(__name__)


class Launcher(EventSourcedService):
    name = "launcher"
    # What a snapshot of its state depends on: the state, its folds (the jobs' too) and the contracts it holds.
    snapshot_code: ClassVar[tuple[str, ...]] = (
        "services/launcher/service.py", "services/launcher/state.py", "services/launcher/planner.py",
        "libs/jobstatus.py", "libs/contracts/*.py", "libs/skeleton/eventsourced.py", "libs/skeleton/snapshots.py")

    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig) -> None:
        super().__init__(runtime)
        self.cluster = cluster
        self.state = LauncherState(on_leave=self._left)
        self.dispatcher = Dispatcher(self, self.state, cluster)
        self.pacer = Pacer()

    @classmethod
    def create(cls, runtime: ServiceRuntime) -> Self:
        return cls(runtime, ClusterConfig.load(runtime.settings.cluster_config))

    # --- state ----------------------------------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        self.state.apply(envelope)

    def save_state(self) -> bytes:
        return self.state.saved()

    def load_state(self, data: bytes) -> None:
        saved = decoded(data)
        del data  # read: let it go before the state is made of it (the base keeps no other reference)
        self.state = LauncherState.restored(saved, on_leave=self._left)
        self.dispatcher.state = self.state

    def _left(self, job_id: str) -> None:
        """An archived job left the state: its launch is never recorded to again, nor sent for."""
        self.forget(LAUNCH, job_id)
        self.dispatcher.forget(job_id)

    def recorded(self, envelope: EventEnvelope) -> None:
        log.info("launch.event", job_id=envelope.aggregate_id, event_type=type(envelope.event).name())

    # --- rules: the agents' reports (admissions are planned by the dispatcher, once ports are chosen) -----

    def upstreams(self) -> Sequence[Upstream]:
        return [
            Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("scheduler", "job", "settings"),
                     consumer=events_consumer("scheduler"), message_type=EventEnvelope, fold=self.state.apply_scheduler,
                     reactions=False),
            Upstream(stream=subjects.AGENT_REPORTS_STREAM, subject=subjects.AGENT_REPORTS_ALL,
                     consumer=AGENT_REPORTS_CONSUMER, message_type=ProcessReport,
                     react=partial(record_report, self.state),
                     key=lambda report: report.job_id,
                     # A report is taken only from the node it names, about its own processes.
                     check=partial(report_refusal, self.state)),
        ]

    # --- loops ----------------------------------------------------------------------------------------

    def loops(self) -> Mapping[str, Loop]:
        return {"dispatch": self.dispatch_loop}

    async def dispatch_loop(self) -> None:
        """Once every upstream is replayed, send what is due after every fold, and at least every second."""
        await self.caught_up()
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 1.0)
            await self.pacer.turn()
            self.wake.clear()
            with self.pacer.run():
                await self.dispatcher.dispatch()
