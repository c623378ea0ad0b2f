"""Which ended jobs leave the state in memory now (pure rule): those that ended more than the administrator's
`job_retention` ago.

A job keeps its place while its debug environment is kept (J15): `trainyard debug` still opens it. An array's jobs
leave together, once every one of them may: an array is one object (`trainyard show ARRAY` counts its jobs). What
leaves is only what the services hold in memory; the log and the search read model answer for it from then on.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from libs.contracts.events import JobArchived
from libs.contracts.jobspec import parse_duration
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import NewEvent
from services.scheduler.domain.names import job_change
from services.scheduler.domain.state import Job, SchedulerState

ARCHIVE_BATCH = 1000  # jobs archived in one append, so that the lock is let go between appends of a long backlog
MIN_RETENTION_SECONDS = 60  # the launcher and monitor settle a job's end within seconds: a minute is ample


def retention_seconds(settings: AdminSettings) -> int:
    """The retention in seconds (an unreadable one, which a settings change refuses, as the default's)."""
    try:
        return max(parse_duration(settings.job_retention), MIN_RETENTION_SECONDS)
    except ValueError:
        return parse_duration(AdminSettings().job_retention)


def archivals(state: SchedulerState, now: datetime, *, limit: int = ARCHIVE_BATCH) -> list[NewEvent]:
    """The JobArchived of the jobs that ended before `now` minus the retention, oldest end first: about `limit`
    of them (an array's jobs all at once, whatever the limit)."""
    before = now - timedelta(seconds=retention_seconds(state.settings))
    retention = state.settings.job_retention
    chosen: list[str] = []
    arrays: dict[str, bool] = {}  # array id -> whether its jobs leave now
    for job in state.ended_in_order():
        if len(chosen) >= limit:
            break
        if job.ended_at is None or job.ended_at > before:
            break
        if job.array is None:
            if _may_leave(job, before):
                chosen.append(job.job_id)
            continue
        array_id = job.array.array_id
        if array_id not in arrays:
            array = state.arrays.get(array_id)
            members = [state.jobs[j] for j in array.jobs.values()] if array is not None else [job]
            arrays[array_id] = all(_may_leave(member, before) for member in members)
            if arrays[array_id]:
                chosen.extend(member.job_id for member in members)
    return [job_change(JobArchived(job_id=job_id, retention=retention)) for job_id in chosen]


def _may_leave(job: Job, before: datetime) -> bool:
    return job.terminal and job.ended_at is not None and job.ended_at <= before and job.kept_until is None
