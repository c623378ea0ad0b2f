"""Who may do what to a job (SPEC J2): the matrix of actions, shared by every service that acts on jobs.

The creator and administrators may do everything. Other members of the job's project get what the
job's `access` grants them — read-only or read-write — unless an administrator switched sharing off,
which forces "none". Everyone else gets nothing.
"""

from __future__ import annotations

from typing import Literal

from libs.contracts.identity import Identity
from libs.contracts.jobspec import JobSpec

JobAction = Literal["view", "clone", "devenv", "tensorboard", "duration", "priority", "stop", "delete", "terminal"]

READ_ONLY_ACTIONS: frozenset[JobAction] = frozenset({"view", "clone", "devenv", "tensorboard"})
READ_WRITE_ACTIONS: frozenset[JobAction] = frozenset({"duration", "priority", "stop", "delete", "terminal"})

Grant = Literal["owner", "read-write", "read-only", "none"]


def grant(identity: Identity, spec: JobSpec, creator: str, *, sharing_enabled: bool) -> Grant:
    if identity.admin or identity.user == creator:
        return "owner"
    if not sharing_enabled or spec.project not in identity.projects:
        return "none"
    return spec.access


def allowed(identity: Identity, spec: JobSpec, creator: str, action: JobAction, *, sharing_enabled: bool) -> bool:
    level = grant(identity, spec, creator, sharing_enabled=sharing_enabled)
    if level in ("owner", "read-write"):
        return True
    return level == "read-only" and action in READ_ONLY_ACTIONS
