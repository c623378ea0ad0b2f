"""The autoscaler's view of demand: which jobs wait, for which flavors, and which run.

It is the shared job-lifecycle fold (libs.lifecycle) read for demand: a job placed and being
pre-checked holds its nodes and asks for no new ones (M1); one requeued after a failed pre-check or a
fault (J12) waits again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from libs.contracts.events import EventEnvelope
from libs.lifecycle import JobLifecycle


@dataclass
class DemandState:
    lifecycle: JobLifecycle = field(default_factory=JobLifecycle)

    def apply(self, envelope: EventEnvelope) -> None:
        self.lifecycle.apply(envelope)

    @property
    def queued(self) -> dict[str, list[str]]:
        """Waiting jobs and the flavors each could use."""
        return {j.job_id: list(j.spec.flavors) for j in self.lifecycle.jobs.values() if j.waiting and not j.deleted}

    @property
    def running(self) -> set[str]:
        return {j.job_id for j in self.lifecycle.jobs.values() if j.status == "running" and not j.deleted}

    def queued_by_flavor(self) -> dict[str, int]:
        """Queued jobs per flavor they could use (a job with two flavors counts for both)."""
        counts: Counter[str] = Counter()
        for flavors in self.queued.values():
            counts.update(flavors)
        return dict(sorted(counts.items()))
