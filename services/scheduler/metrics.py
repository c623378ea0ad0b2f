"""The scheduler's metrics (libs/telemetry/metrics.py): its queue and jobs sampled from the state, what it decided
counted as it is recorded, and how long its cycles and plans take."""

from __future__ import annotations

from collections import Counter

from libs.contracts.events import EventEnvelope, JobAdmitted, JobRestarting, JobResuming
from libs.contracts.jobspec import PRIORITY_RANK
from libs.contracts.operations.base import JOB_STATUSES
from libs.telemetry.metrics import (
    ADMISSIONS,
    CYCLE_DURATION,
    JOBS,
    JOBS_QUEUED,
    PREDICTION_DURATION,
    RESTARTS,
    RESUMES,
    SampledGauge,
    counter,
    histogram,
)
from services.scheduler.domain.state import SchedulerState

_queued = SampledGauge(JOBS_QUEUED)
_jobs = SampledGauge(JOBS)
_admissions = counter(ADMISSIONS)
_resumes = counter(RESUMES)
_restarts = counter(RESTARTS)
cycle_durations = histogram(CYCLE_DURATION)
prediction_durations = histogram(PREDICTION_DURATION)


def sample(state: SchedulerState) -> None:
    """Set the gauges from the state: the queue by priority and first flavor (every priority and flavor of the
    cluster, zeros included, so that a chart of an empty queue shows zero rather than nothing), every job by state."""
    queued: Counter[tuple[str, ...]] = Counter()
    for job in state.active.values():
        if job.status == "queued" and not job.deleted:
            queued[(job.priority, job.spec.flavors[0] if job.spec.flavors else "")] += 1
    flavors = {flavor.name for flavor in state.cluster.flavors}
    _queued.set({**{(priority, flavor): 0 for priority in PRIORITY_RANK for flavor in flavors}, **queued})
    by_state = state.status_counts()  # kept as the jobs' events are folded: no walk over every job there ever was
    _jobs.set({(status,): by_state.get(status, 0) for status in JOB_STATUSES})


def count(envelope: EventEnvelope, state: SchedulerState) -> None:
    """Count a newly recorded decision: an admission (by the job's priority), a resume, a restart."""
    event = envelope.event
    if isinstance(event, JobAdmitted):
        job = state.jobs.get(event.job_id)
        _admissions.add(1, {"trainyard.priority": job.priority if job is not None else "normal"})
    elif isinstance(event, JobResuming):
        _resumes.add(1)
    elif isinstance(event, JobRestarting):
        _restarts.add(1)
