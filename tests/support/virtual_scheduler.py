"""The scheduler's own state fold (`SchedulerState`) and cycle rules (`cycle.decide`, `cycle.admissions`), driven
by events at virtual instants as the service records them: the reality a simulation is held to."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from libs.contracts.cluster import ClusterConfig, Flavor
from libs.contracts.events import EventEnvelope, JobSucceeded
from services.scheduler.domain.state import SchedulerState
from services.scheduler.rules.cycle import admissions, decide


class VirtualScheduler:
    """The scheduler's fold and cycle rules, driven in virtual time."""

    def __init__(self, flavors: dict[str, Flavor]) -> None:
        self.state = SchedulerState(ClusterConfig(flavors=list(flavors.values())))
        self.position = 0
        self.started: dict[str, datetime] = {}

    def record(self, event: Any, at: datetime, service: str = "scheduler", aggregate: str = "x") -> None:
        self.position += 1
        self.state.apply(EventEnvelope(event_id=str(self.position), service=service, aggregate_type="t",
                                       aggregate_id=aggregate, version=self.position, position=self.position,
                                       recorded_at=at, event=event))

    def cycles(self, now: datetime) -> None:
        """As the service does at `now`: a cycle, and again after its own admissions, until nothing starts."""
        for _ in range(8):
            decision = decide(self.state, now)
            if decision is None or not decision.admissions:
                return
            for change in admissions(self.state, decision, now):
                self.record(change.event, now, aggregate=change.aggregate_id)
            for admission in decision.admissions:
                self.started[admission.job_id] = now

    def next_end(self) -> datetime | None:
        ends = [job.ends_at for job in self.state.running() if job.ends_at is not None]
        return min(ends) if ends else None

    def end_jobs(self, now: datetime) -> None:
        """Every job past its limit finishes then."""
        for job in list(self.state.running()):
            if job.ends_at is not None and job.ends_at <= now:
                self.record(JobSucceeded(job_id=job.job_id), now, aggregate=job.job_id)
