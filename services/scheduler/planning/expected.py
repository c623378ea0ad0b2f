"""What the runtime model expects of jobs, where it knows better than their duration limits: the ends of running
jobs and the runtimes of queued ones, which every plan and prediction takes in place of the limits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from libs.placement import QueuedJob, RunningJob


@dataclass(frozen=True)
class Expected:
    """When jobs will likely end, where that is known better than their duration limits.

    Jobs not listed end at their limits; a listed None means no end is known (held for good).
    """

    ends: Mapping[str, datetime | None] = field(default_factory=dict)  # running job -> likely end
    seconds: Mapping[str, int | None] = field(default_factory=dict)  # queued job -> likely runtime

    @property
    def empty(self) -> bool:
        return not self.ends and not self.seconds

    def running(self, jobs: Sequence[RunningJob]) -> list[RunningJob]:
        return [job.changed(ends_at=self.ends[job.job_id]) if job.job_id in self.ends else job for job in jobs]

    def queue(self, jobs: Sequence[QueuedJob]) -> list[QueuedJob]:
        return [job.lasting(self.seconds[job.job_id]) if job.job_id in self.seconds else job for job in jobs]
