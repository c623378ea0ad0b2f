"""What the scheduler records of the predictions it plans after jobs are accepted (S6).

A job submitted without asking for its prediction has it planned a moment later, together with those of
the other jobs submitted meanwhile (`forecast_queued`), and recorded in one append. A job still queued
gets what the plan says; one the scheduler admitted before its prediction was recorded gets the start it
had. A job that ended without ever starting needs none (the state forgets it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from libs.contracts.events import JobPredicted
from libs.eventstore import NewEvent
from services.scheduler.names import job_change
from services.scheduler.prediction import Forecast, started
from services.scheduler.state import SchedulerState

MAX_PLANNED = 1000  # jobs whose predictions are planned and recorded together


def to_plan(state: SchedulerState) -> list[str]:
    """The queued jobs, oldest first, whose predictions the next plan makes."""
    return [job_id for job_id in list(state.unpredicted)[:MAX_PLANNED]
            if state.jobs[job_id].status == "queued" and not state.jobs[job_id].prechecking]


def predictions(state: SchedulerState, forecasts: Mapping[str, Forecast]) -> list[NewEvent]:
    """A prediction for every job that waits for one and can have it now: from `forecasts` for a job still
    queued, or the start it had for a job admitted since (traced as the job is)."""
    changes: list[NewEvent] = []
    waiting: Sequence[str] = list(state.unpredicted)[:MAX_PLANNED]
    for job_id in waiting:
        job = state.jobs[job_id]
        forecast = forecasts.get(job_id) if job.status == "queued" else None
        if forecast is None and job.flavor is not None and job.placement and job.started_at is not None:
            forecast = started(job.flavor, job.placement, job.started_at)
        if forecast is not None:
            change = job_change(JobPredicted(job_id=job_id, prediction=forecast.prediction))
            changes.append(NewEvent(change.aggregate_type, change.aggregate_id, change.event, trace=job.trace))
    return changes
