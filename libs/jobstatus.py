"""What state a job is in, folded from the scheduler's events: the one reading other services embed.

The launcher, monitor and autoscaler each follow the scheduler's job events. Rather than each deriving
a job's status with rules of its own, they embed this fold and keep beside it only what is theirs
(launches, pre-checks, demand). Events are keyed by their envelope's aggregate id; events of other
services, and settings, pass through `apply` untouched except for the administrator settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.access import allowed
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobExpired,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobRequeued,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    Placement,
    SettingsChanged,
)
from libs.contracts.identity import Identity
from libs.contracts.images import ImageUse
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.base import JobStatus
from libs.contracts.scheduling import AdminSettings

SCHEDULER = "scheduler"
ENDINGS: dict[type, JobStatus] = {JobSucceeded: "succeeded", JobFailed: "failed", JobStopped: "stopped",
                                  JobExpired: "expired"}


@dataclass
class JobRecord:
    job_id: str
    spec: JobSpec
    creator: str
    creator_email: str | None
    status: JobStatus = "queued"
    held: bool = False  # placed, its nodes held while they are pre-checked (M1): it waits for no nodes
    attempt: int = 0
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    nodes_used: dict[str, None] = field(default_factory=dict)  # every node of every attempt, in order
    resumes: int = 0
    deleted: bool = False
    trace: dict[str, str] = field(default_factory=dict)  # of its latest admission (else its submission)
    image: ImageUse | None = None  # J10: the image it runs in, as accepted
    archived: bool = False  # ended long ago (JobArchived): no longer in the state

    @property
    def ended(self) -> bool:
        return self.status in ENDINGS.values()

    @property
    def waiting(self) -> bool:
        """In the queue and holding no nodes: it asks for resources."""
        return self.status == "queued" and not self.held

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
class JobLifecycle:
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    settings: AdminSettings = field(default_factory=AdminSettings)

    def apply(self, envelope: EventEnvelope) -> JobRecord | None:
        """Fold a scheduler event; return the job it changed, if any (an archived one, `archived`, has left
        `jobs`)."""
        if envelope.service != SCHEDULER:
            return None
        event = envelope.event
        if isinstance(event, SettingsChanged):
            self.settings = event.settings
            return None
        if isinstance(event, JobSubmitted):
            submitted = JobRecord(job_id=envelope.aggregate_id, spec=event.spec, creator=event.creator,
                                  creator_email=event.creator_email, trace=envelope.trace, image=event.image)
            self.jobs[submitted.job_id] = submitted
            return submitted
        job = self.jobs.get(envelope.aggregate_id)
        if job is None or envelope.aggregate_type != "job":
            return None
        if isinstance(event, JobArchived):  # it leaves the state; its caller drops what it keeps of it too
            del self.jobs[job.job_id]
            job.archived = True
        elif isinstance(event, JobAdmitted):
            job.status, job.held, job.attempt = "running", False, event.attempt
            job.flavor, job.placement = event.flavor, list(event.placement)
            job.nodes_used.update(dict.fromkeys(p.node for p in event.placement))
            job.trace = envelope.trace or job.trace
        elif isinstance(event, JobPrechecking):
            job.held = True
        elif isinstance(event, JobPrecheckFailed):
            job.status, job.held = "queued", False
        elif isinstance(event, JobRequeued):
            job.status, job.held, job.resumes = "queued", False, event.resumes
        elif isinstance(event, JobDeleted):
            job.deleted = True
        elif (status := ENDINGS.get(type(event))) is not None:
            job.status, job.held = status, False
        return job

    def viewable(self, job_id: str, identity: Identity) -> JobRecord | None:
        """The job, if `identity` may view it (J2); None for one not known, deleted or hidden from it, which its
        callers answer as a job that does not exist, so that ids cannot be probed."""
        job = self.jobs.get(job_id)
        if job is None or job.deleted or not allowed(identity, job.spec, job.creator, "view",
                                                     sharing_enabled=self.settings.sharing_enabled):
            return None
        return job

    def running_on(self, node: str) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.status == "running" and node in j.nodes]
