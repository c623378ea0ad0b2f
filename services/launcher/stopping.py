"""How the launcher asks an agent to stop an attempt (SPEC J12, M3).

A checkpoint-resume job is told to save before it goes: every process of it that handles the
checkpoint signal gets it, and the job has its graceful shutdown time (within the administrator's
cap) before what is left is killed. Other jobs get SIGTERM and the platform's stop grace.
"""

from __future__ import annotations

from libs.contracts.agent import StopProcesses
from libs.contracts.health import CHECKPOINT_SIGNAL
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import AdminSettings
from services.launcher.state import Launch

# The agent answers a stop once the processes are gone, which may take the whole grace.
STOP_REPLY_MARGIN_SECONDS = 5.0


def stop_request(launch: Launch, spec: JobSpec | None, settings: AdminSettings, *, default_grace: float,
                 task: int | None = None) -> StopProcesses:
    """The stop of the whole attempt (`task` None), or of one finished task's helpers."""
    resume = spec.checkpoint_resume if spec is not None else None
    # A finished task's helpers and the leftovers of a succeeded attempt have nothing left to save.
    if resume is None or task is not None or launch.outcome == "succeeded":
        return StopProcesses(job_id=launch.job_id, attempt=launch.attempt, task=task, grace_seconds=default_grace)
    grace = min(resume.graceful_shutdown_seconds, settings.max_graceful_shutdown_seconds)
    return StopProcesses(job_id=launch.job_id, attempt=launch.attempt, grace_seconds=float(grace),
                         checkpoint_signal=CHECKPOINT_SIGNAL)


def reply_timeout(request: StopProcesses) -> float:
    return request.grace_seconds + STOP_REPLY_MARGIN_SECONDS
