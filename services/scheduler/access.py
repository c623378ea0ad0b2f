"""Who may do what to a job (SPEC J2): the operation matrix, enforced by the scheduler itself.

The creator and administrators may do everything. Other members of the job's project get what the
job's `access` grants them — read-only or read-write — unless an administrator switched sharing off,
which forces "none". Everyone else gets nothing, and is told the job does not exist rather than that
it is hidden, so ids of others' jobs cannot be probed.
"""

from __future__ import annotations

from typing import Literal

from libs.contracts.identity import Identity
from libs.contracts.jobspec import JobSpec
from libs.contracts.messages import CommandError
from services.scheduler.state import Job, SchedulerState

Operation = Literal["view", "clone", "devenv", "tensorboard", "duration", "priority", "stop", "delete"]

READ_ONLY_OPERATIONS: frozenset[Operation] = frozenset({"view", "clone", "devenv", "tensorboard"})
READ_WRITE_OPERATIONS: frozenset[Operation] = frozenset({"duration", "priority", "stop", "delete"})

Grant = Literal["owner", "read-write", "read-only", "none"]


def grant(identity: Identity, spec: JobSpec, creator: str, *, sharing_enabled: bool) -> Grant:
    if identity.admin or identity.user == creator:
        return "owner"
    if not sharing_enabled or spec.project not in identity.projects:
        return "none"
    return spec.access


def allowed(identity: Identity, spec: JobSpec, creator: str, operation: Operation, *, sharing_enabled: bool) -> bool:
    level = grant(identity, spec, creator, sharing_enabled=sharing_enabled)
    if level in ("owner", "read-write"):
        return True
    return level == "read-only" and operation in READ_ONLY_OPERATIONS


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
