"""Is a job spec acceptable here: the spec's own rules, this cluster's flavors and the platform caps.

Used by submissions (commands.py) and predictions (queries.py), so both refuse a spec the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from libs.contracts.cluster import ClusterConfig
from libs.contracts.images import ImageRecord
from libs.contracts.jobspec import FieldError, JobSpec, validate_spec
from libs.contracts.operations.base import CommandError
from libs.contracts.scheduling import AdminSettings
from services.scheduler.domain.images import image_errors


def spec_errors(spec: JobSpec, cluster: ClusterConfig, images: Mapping[str, ImageRecord]) -> list[FieldError]:
    """The spec's own rules (J1–J18), flavors this cluster offers, and an image of its catalogue (J10)."""
    known = [f.name for f in cluster.flavors]
    return validate_spec(spec) + image_errors(spec, images, cluster.flavors) + [
        FieldError(field=f"flavors[{i}]", message=f"{name!r} is not a flavor of this cluster",
                   hint=f"choose from: {', '.join(known)}")
        for i, name in enumerate(spec.flavors) if name not in known
    ]


def cap_errors(spec: JobSpec, settings: AdminSettings) -> list[FieldError]:
    """What the spec asks beyond the administrator's caps on resuming (J12, M3)."""
    errors: list[FieldError] = []
    resume = spec.checkpoint_resume
    if resume is not None and resume.max_resumes > settings.max_resumes_cap:
        errors.append(FieldError(field="checkpoint_resume.max_resumes",
                                 message=f"is {resume.max_resumes}, above the platform cap of "
                                 f"{settings.max_resumes_cap}"))
    if resume is not None and resume.graceful_shutdown_seconds > settings.max_graceful_shutdown_seconds:
        errors.append(FieldError(field="checkpoint_resume.graceful_shutdown_seconds",
                                 message=f"is {resume.graceful_shutdown_seconds}, above the platform cap of "
                                 f"{settings.max_graceful_shutdown_seconds}"))
    return errors


def invalid_spec(errors: list[FieldError]) -> CommandError:
    return CommandError(code="invalid-spec", message="the job spec is invalid: " + "; ".join(map(str, errors)),
                        errors=errors)
