"""Submissions recorded together (group commit).

Every submission that arrives while an append is being written joins the next one, so a burst of them
costs one transaction and one hold of the append lock rather than one each; each is still answered only
once its events are committed, and one that cannot be recorded (the database away) is answered with the
error, never accepted. What a batch records is decided by `decide`, a pure rule on the state and the
users' submission buckets: in order, a job id seen before gets the first answer again (or `conflict`), and
the urgent cap (S2) and the per-user limits (limits.py) count the jobs accepted earlier in the same batch.
The buckets the batch took from are kept only once its events are committed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from libs.contracts.events import JobPredicted, JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.jobspec import JobSpec, Priority
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JobAccepted
from libs.contracts.scheduling import Prediction
from libs.eventstore import NewEvent
from services.scheduler.domain.images import LIST_HINT, image_use
from services.scheduler.domain.limits import (
    TokenBucket,
    queued_counts,
    queued_error,
    queued_limit_reachable,
    rate_taken,
)
from services.scheduler.domain.names import JOB
from services.scheduler.domain.state import SchedulerState

ACTIVE = ("queued", "running")
MAX_BATCH = 500  # submissions in one append: a few MiB of events at most
Answer = JobAccepted | CommandError
Recorder = Callable[[Sequence[NewEvent]], Awaitable[object]]  # the service's `record`


@dataclass(frozen=True)
class Submission:
    """A job to create, checked already against everything but the queue as it is when it is recorded."""

    job_id: str
    spec: JobSpec
    identity: Identity
    cloned_from: str | None = None
    prediction: Prediction | None = None  # planned before it joined, when the caller asked for it
    trace: dict[str, str] | None = None  # of the request that submitted it
    # When it was asked for, by the scheduler's clock: its submission is taken from the user's bucket then. None
    # (only tests of other rules) takes nothing.
    at: datetime | None = None


def retried(state: SchedulerState, job_id: str, spec: JobSpec, identity: Identity) -> Answer | None:
    """The answer to a request whose job exists already: the same as the first time."""
    existing = state.jobs.get(job_id)
    if existing is None:
        return None
    if existing.spec != spec or existing.creator != identity.user:
        return CommandError(code="conflict", message=f"job {job_id} exists with another spec",
                            hint="submit again without choosing the id")
    return JobAccepted(job_id=job_id, status=existing.status, created=False, prediction=existing.prediction)


def urgent_cap_error(state: SchedulerState, project: str, user: str, priority: Priority, *,
                     ignore: str | None = None, also: int = 0) -> CommandError | None:
    """S2: a user's running + queued urgent jobs in one project are capped (`also`: more of them, accepted
    but not yet recorded)."""
    if priority != "urgent":
        return None
    cap = state.settings.urgent_cap
    urgent = also + sum(1 for j in state.active.values()
                        if j.creator == user and j.spec.project == project and j.priority == "urgent"
                        and j.status in ACTIVE and j.job_id != ignore)
    if urgent < cap:
        return None
    return CommandError(code="over-cap",
                        message=f"{user} already has {urgent} urgent jobs queued or running in project "
                        f"{project!r}; the cap is {cap}",
                        hint="wait for one to end, or lower one to normal: trainyard priority JOB normal")


@dataclass(frozen=True)
class Decided:
    """A batch's answers, in order, the events that create the accepted jobs, and the buckets of the users
    whose submissions were accepted, as they are once those are taken."""

    answers: list[Answer]
    changes: list[NewEvent]
    buckets: dict[str, TokenBucket] = field(default_factory=dict)


def decide(state: SchedulerState, submissions: Sequence[Submission],
           buckets: Mapping[str, TokenBucket]) -> Decided:
    """What a batch records, with the users' submission buckets as they are before it."""
    answers: list[Answer] = []
    changes: list[NewEvent] = []
    first: dict[str, Submission] = {}  # accepted in this batch, by job id
    urgent: Counter[tuple[str, str]] = Counter()  # urgent jobs accepted in this batch, per project and user
    # Each submitter's jobs waiting to start, and then those the batch accepted; their buckets it took from.
    users = {submission.identity.user for submission in submissions}
    queued = (queued_counts(state, users) if queued_limit_reachable(state, len(submissions), state.settings)
              else Counter[str]())  # no one can pass the limit: counting from none is as good
    taken: dict[str, TokenBucket] = {}
    for submission in submissions:
        job_id, spec, user = submission.job_id, submission.spec, submission.identity.user
        if (answer := retried(state, job_id, spec, submission.identity)) is not None:
            answers.append(answer)
            continue
        if (earlier := first.get(job_id)) is not None:
            same = earlier.spec == spec and earlier.identity.user == user
            answers.append(JobAccepted(job_id=job_id, status="queued", created=False, prediction=earlier.prediction)
                           if same else CommandError(code="conflict", message=f"job {job_id} exists with another spec",
                                                     hint="submit again without choosing the id"))
            continue
        if error := urgent_cap_error(state, spec.project, user, spec.priority, also=urgent[(spec.project, user)]):
            answers.append(error)
            continue
        try:
            image = image_use(spec, state.images)
        except LookupError as exc:
            answers.append(CommandError(code="invalid-spec", message=str(exc), hint=LIST_HINT))
            continue
        if error := queued_error(user, queued[user], 1, state.settings):
            answers.append(error)
            continue
        if submission.at is not None:
            bucket = rate_taken(user, taken.get(user, buckets.get(user)), 1, submission.at, state.settings)
            if isinstance(bucket, CommandError):
                answers.append(bucket)
                continue
            taken[user] = bucket
        queued[user] += 1
        first[job_id] = submission
        if spec.priority == "urgent":
            urgent[(spec.project, user)] += 1
        changes.append(NewEvent(JOB, job_id, JobSubmitted(job_id=job_id, spec=spec, creator=user,
                                                          cloned_from=submission.cloned_from,
                                                          creator_email=submission.identity.email, image=image),
                                trace=submission.trace))
        if submission.prediction is not None:
            changes.append(NewEvent(JOB, job_id, JobPredicted(job_id=job_id, prediction=submission.prediction),
                                    trace=submission.trace))
        answers.append(JobAccepted(job_id=job_id, status="queued", created=True, prediction=submission.prediction))
    return Decided(answers=answers, changes=changes, buckets=taken)


class SubmissionBatches:
    """Records submissions in batches, one append at a time, through `record` under `lock`."""

    def __init__(self, state: SchedulerState, lock: asyncio.Lock, record: Recorder) -> None:
        self.state, self.lock, self.record = state, lock, record
        # Each user's submission bucket (limits.py), changed under `lock` once what took from it is committed.
        # In memory only: a new scheduler starts with every bucket full.
        self.buckets: dict[str, TokenBucket] = {}
        self._waiting: list[tuple[Submission, asyncio.Future[Answer]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def submit(self, submission: Submission) -> Answer:
        """The submission's answer, once the batch it joined is recorded (or could not be)."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((submission, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="scheduler.submissions")
        return await future

    async def _write(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                async with self.lock:
                    decided = decide(self.state, [submission for submission, _ in batch], self.buckets)
                    await self.record(decided.changes)
                    self.buckets.update(decided.buckets)
            except Exception as exc:  # nothing of the batch was recorded: each is told why
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), answer in zip(batch, decided.answers, strict=True):
                if not future.done():
                    future.set_result(answer)
