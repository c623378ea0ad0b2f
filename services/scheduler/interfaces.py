"""What the command, query and log handlers use of the scheduler, so they need not know the service.

The service (service.py) gives these; a test may give them with anything else that has them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Protocol

from libs.contracts.events import EventEnvelope
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import Prediction
from libs.eventstore import NewEvent, Tracking
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.prediction import Forecast
from services.scheduler.read_model import JobSearchProjection
from services.scheduler.rules.submissions import SubmissionBatches


class Jobs(Protocol):
    """The scheduler's state, read by every handler."""

    @property
    def state(self) -> SchedulerState: ...


class Reading(Jobs, Protocol):
    """What the views of the state read: the live scheduler, or the scheduler as it was at a past instant
    (past.py), whose clock stands still there."""

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every decision: folds, reactions, cycles and the commands that change jobs."""

    @property
    def clock(self) -> Callable[[], datetime]: ...

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        """S6 for jobs already queued (those no longer queued get none); planned without the lock."""


class Scheduling(Reading, Protocol):
    """The scheduler as its commands and queries use it."""

    @property
    def submissions(self) -> SubmissionBatches:
        """Submissions recorded in batches (group commit)."""

    @property
    def search(self) -> JobSearchProjection:
        """The job search read model (O2)."""

    async def predict(self, spec: JobSpec) -> Prediction:
        """S6 for `spec` as if it were submitted now; planned without the lock."""

    async def record(self, changes: Sequence[NewEvent], tracking: Tracking | None = None) -> list[EventEnvelope]:
        """Append `changes` at the versions folded so far, and fold them."""

    async def record_to_archived(self, changes: Sequence[NewEvent]) -> list[EventEnvelope]:
        """Append `changes` to archived jobs, at their versions in the log."""
