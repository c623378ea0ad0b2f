"""The monitor's view of jobs, folded from the scheduler's events (never written by the monitor).

It knows what the monitor's reactions need: each job's spec, creator and creator's email (alerts),
its status, current attempt and placement (pre-checks, performance, debug terminals), every node it
ever ran on (kept workspaces to release), and the administrator settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobExpired,
    JobFailed,
    JobPrecheckFailed,
    JobRequeued,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    Placement,
    SettingsChanged,
)
from libs.contracts.jobspec import JobSpec
from libs.contracts.messages import JobStatus
from libs.contracts.scheduling import AdminSettings

_ENDINGS: dict[type, JobStatus] = {JobSucceeded: "succeeded", JobFailed: "failed", JobStopped: "stopped",
                                   JobExpired: "expired"}


@dataclass
class FollowedJob:
    job_id: str
    spec: JobSpec
    creator: str
    creator_email: str | None
    status: JobStatus = "queued"
    attempt: int = 0
    placement: list[Placement] = field(default_factory=list)
    nodes_used: dict[str, None] = field(default_factory=dict)  # every node of every attempt, in order
    resumes: int = 0
    deleted: bool = False
    trace: dict[str, str] = field(default_factory=dict)  # of its latest admission (else its submission)

    @property
    def nodes(self) -> list[str]:
        """The nodes of its current (or last) placement, by rank."""
        return list(dict.fromkeys(p.node for p in sorted(self.placement, key=lambda p: p.rank)))

    @property
    def checkpoint_resume(self) -> bool:
        return self.spec.checkpoint_resume is not None

    @property
    def debug_terminal(self) -> bool:
        return self.spec.debug_terminal is not None and self.spec.debug_terminal.enabled

    def max_resumes(self, settings: AdminSettings) -> int:
        resume = self.spec.checkpoint_resume
        return min(resume.max_resumes, settings.max_resumes_cap) if resume else 0


@dataclass
class JobsView:
    jobs: dict[str, FollowedJob] = field(default_factory=dict)
    settings: AdminSettings = field(default_factory=AdminSettings)

    def apply(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, SettingsChanged):
            self.settings = event.settings
            return
        if isinstance(event, JobSubmitted):
            self.jobs[event.job_id] = FollowedJob(job_id=event.job_id, spec=event.spec, creator=event.creator,
                                                  creator_email=event.creator_email, trace=envelope.trace)
            return
        job = self.jobs.get(envelope.aggregate_id)
        if job is None:
            return
        if isinstance(event, JobAdmitted):
            job.status, job.attempt, job.placement = "running", event.attempt, event.placement
            job.nodes_used.update(dict.fromkeys(p.node for p in event.placement))
            job.trace = envelope.trace or job.trace
        elif isinstance(event, JobPrecheckFailed):
            job.status = "queued"
        elif isinstance(event, JobRequeued):
            job.status, job.resumes = "queued", event.resumes
        elif isinstance(event, JobDeleted):
            job.deleted = True
        elif (status := _ENDINGS.get(type(event))) is not None:
            job.status = status

    def running_on(self, node: str) -> list[FollowedJob]:
        return [j for j in self.jobs.values() if j.status == "running" and node in j.nodes]
