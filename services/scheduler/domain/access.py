"""J2 enforced by the scheduler: the matrix of `libs.access` applied to requests about its jobs.

Jobs a caller may not view are reported as not found rather than hidden, so ids of others' jobs
cannot be probed: every operation answers a job (or array) the caller may not view with the very
reply it gives an id that never existed, and only then tells a caller who may view it that they
may not change it.
"""

from __future__ import annotations

from collections.abc import Iterable

from libs.access import JobAction, allowed
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from services.scheduler.domain.state import Job, SchedulerState

NOT_FOUND_HINT = "`trainyard list` shows the jobs you can see; nothing was changed"
ARRAY_NOT_FOUND_HINT = "`trainyard list` shows the arrays you can see; nothing was changed"


def job_not_found(job_ids: Iterable[str]) -> CommandError:
    """The one reply for ids that are unknown, deleted or not the caller's to view."""
    return CommandError(code="not-found", message=f"no such job: {', '.join(job_ids)}", hint=NOT_FOUND_HINT)


def array_not_found(array_ids: Iterable[str]) -> CommandError:
    """The one reply for array ids that are unknown or whose jobs are not the caller's to view."""
    return CommandError(code="not-found", message=f"no such array: {', '.join(array_ids)}", hint=ARRAY_NOT_FOUND_HINT)


def access_error(state: SchedulerState, job_ids: list[str], identity: Identity,
                 operation: JobAction) -> CommandError | None:
    """Refuse the whole request when any job is unknown to the caller or the operation is not theirs.

    Jobs the caller may not view are reported as not found, exactly like deleted or unknown ids.
    """
    sharing = state.settings.sharing_enabled
    missing: list[str] = []
    refused: list[str] = []
    for job_id in dict.fromkeys(job_ids):
        job = state.jobs.get(job_id)
        if job is None or not can_view(state, identity, job):
            missing.append(job_id)
        elif not allowed(identity, job.spec, job.creator, operation, sharing_enabled=sharing):
            refused.append(job_id)
    if missing:
        return job_not_found(missing)
    if refused:
        return CommandError(code="forbidden",
                            message=f"you have read-only access to {', '.join(refused)}: {operation} needs read-write",
                            hint="ask the job's creator or an administrator; nothing was changed")
    return None


def array_access_error(state: SchedulerState, array_ids: Iterable[str], identity: Identity) -> CommandError | None:
    """Refuse a request naming arrays that are unknown to the caller, before their indices are looked at
    (an index error would tell that the array exists).

    An array is the caller's to name when they may view its jobs (which share one creator and one
    spec's access); deleted ones count, so that a delete sent again is answered as the first one was.
    """
    hidden = [array_id for array_id in dict.fromkeys(array_ids) if not _names_array(state, identity, array_id)]
    return array_not_found(hidden) if hidden else None


def _names_array(state: SchedulerState, identity: Identity, array_id: str) -> bool:
    array = state.arrays.get(array_id)
    if array is None:
        return False
    sharing = state.settings.sharing_enabled
    return any(allowed(identity, job.spec, job.creator, "view", sharing_enabled=sharing)
               for job_id in array.jobs.values() if (job := state.jobs.get(job_id)) is not None)


def can_view(state: SchedulerState, identity: Identity, job: Job) -> bool:
    return not job.deleted and allowed(identity, job.spec, job.creator, "view",
                                       sharing_enabled=state.settings.sharing_enabled)
