"""J2 enforced by the scheduler: the matrix of `libs.access` applied to requests about its jobs.

Jobs a caller may not view are reported as not found rather than hidden, so ids of others' jobs
cannot be probed.
"""

from __future__ import annotations

from libs.access import Operation, allowed
from libs.contracts.identity import Identity
from libs.contracts.messages import CommandError
from services.scheduler.state import Job, SchedulerState


def access_error(state: SchedulerState, job_ids: list[str], identity: Identity,
                 operation: Operation) -> CommandError | None:
    """Refuse the whole request when any job is unknown to the caller or the operation is not theirs.

    Jobs the caller may not view are reported as not found, exactly like deleted or unknown ids.
    """
    sharing = state.settings.sharing_enabled
    missing: list[str] = []
    refused: list[str] = []
    for job_id in dict.fromkeys(job_ids):
        job = state.jobs.get(job_id)
        if job is None or job.deleted or not allowed(identity, job.spec, job.creator, "view", sharing_enabled=sharing):
            missing.append(job_id)
        elif not allowed(identity, job.spec, job.creator, operation, sharing_enabled=sharing):
            refused.append(job_id)
    if missing:
        return CommandError(code="not-found", message=f"no such job: {', '.join(missing)}",
                            hint="`trainyard list` shows the jobs you can see; nothing was changed")
    if refused:
        return CommandError(code="forbidden",
                            message=f"you have read-only access to {', '.join(refused)}: {operation} needs read-write",
                            hint="ask the job's creator or an administrator; nothing was changed")
    return None


def can_view(state: SchedulerState, identity: Identity, job: Job) -> bool:
    return not job.deleted and allowed(identity, job.spec, job.creator, "view",
                                       sharing_enabled=state.settings.sharing_enabled)
