"""The autoscaler's view of demand: which jobs wait, for which flavors, and which run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobExpired,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobRequeued,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
)


@dataclass
class DemandState:
    queued: dict[str, list[str]] = field(default_factory=dict)  # job id -> acceptable flavors
    running: set[str] = field(default_factory=set)
    flavors: dict[str, list[str]] = field(default_factory=dict)  # of every job not ended yet

    def apply(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, JobSubmitted):
            self.flavors[event.job_id] = list(event.spec.flavors)
            self.queued[event.job_id] = list(event.spec.flavors)
        elif isinstance(event, JobPrechecking):
            # Placed: its nodes are held while they are checked, so it asks for no new ones (M1).
            self.queued.pop(event.job_id, None)
        elif isinstance(event, JobPrecheckFailed | JobRequeued) and event.job_id in self.flavors:
            # Waiting for nodes again: after a failed pre-check, or moved off a faulty node (J12).
            self.queued[event.job_id] = self.flavors[event.job_id]
            self.running.discard(event.job_id)
        elif isinstance(event, JobAdmitted):
            self.queued.pop(event.job_id, None)
            self.running.add(event.job_id)
        elif isinstance(event, JobSucceeded | JobFailed | JobStopped | JobExpired | JobDeleted):
            self.queued.pop(event.job_id, None)
            self.running.discard(event.job_id)
            self.flavors.pop(event.job_id, None)

    def queued_by_flavor(self) -> dict[str, int]:
        """Queued jobs per flavor they could use (a job with two flavors counts for both)."""
        counts: Counter[str] = Counter()
        for flavors in self.queued.values():
            counts.update(flavors)
        return dict(sorted(counts.items()))
