"""What the scheduler records of the predictions it plans after jobs are accepted (S6).

A job submitted without asking for its prediction has it planned a moment later, once a scheduling cycle
left it waiting, together with those of the other jobs submitted meanwhile (`forecast_queued`), and recorded
in one append. A job still queued gets what the plan says; one the scheduler admitted before its prediction
was recorded gets the start it had (most jobs on a cluster with room: their next cycle admits them, and
playing the queue forward for them would only have said so). A job that ended without ever starting needs
none (the state forgets it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from libs.contracts.events import JobPredicted
from libs.eventstore import NewEvent
from services.scheduler.domain.names import job_change
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.prediction import Forecast, started

MAX_PLANNED = 1000  # jobs whose predictions are planned and recorded together


def to_plan(state: SchedulerState, cycle_saw: int) -> list[str]:
    """The queued jobs, oldest first, whose predictions the next plan makes: those a scheduling cycle already
    looked at and left waiting (`cycle_saw`: the log position of the newest submission the last cycle saw). A job
    the next cycle admits has its start recorded as its prediction then, with no plan played for it."""
    return [job_id for job_id in itertools.islice(state.unpredicted, MAX_PLANNED)
            if (job := state.jobs[job_id]).queue_order <= cycle_saw and job.status == "queued"
            and not job.prechecking]


def left_waiting(state: SchedulerState, cycle_saw: int) -> bool:
    """Whether a job a cycle looked at still waits for its prediction (the oldest waiting one tells)."""
    oldest = next(iter(state.unpredicted), None)
    return oldest is not None and state.jobs[oldest].queue_order <= cycle_saw


def newest_waiting(state: SchedulerState) -> int:
    """The log position of the newest submission still waiting for its prediction (0: none waits)."""
    newest = next(reversed(state.unpredicted), None)
    return state.jobs[newest].queue_order if newest is not None else 0


def predictions(state: SchedulerState, forecasts: Mapping[str, Forecast]) -> list[NewEvent]:
    """A prediction for every job that waits for one and can have it now: from `forecasts` for a job still
    queued, or the start it had for a job admitted since (traced as the job is)."""
    changes: list[NewEvent] = []
    waiting: Sequence[str] = list(itertools.islice(state.unpredicted, MAX_PLANNED))
    for job_id in waiting:
        job = state.jobs[job_id]
        forecast = forecasts.get(job_id) if job.status == "queued" else None
        if forecast is None and job.flavor is not None and job.placement and job.started_at is not None:
            forecast = started(job.flavor, job.placement, job.started_at)
        if forecast is not None:
            change = job_change(JobPredicted(job_id=job_id, prediction=forecast.prediction))
            changes.append(NewEvent(change.aggregate_type, change.aggregate_id, change.event, trace=job.trace))
    return changes
