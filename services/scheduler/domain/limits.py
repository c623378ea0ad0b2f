"""Per-user limits on creating jobs: how many a user may have queued, and how fast they may submit.

Both count the jobs a request would create (an array of N counts N; a clone counts as a submit) and apply to
every user, administrators too, across all of their projects (one user in many projects gets no more).

- Queued jobs (`max_queued_jobs_per_user`, as Slurm's MaxSubmitJobs): the creator's jobs waiting to start,
  counted from the state, so they hold after a restart.
- Submissions per second: a token bucket per user of `submit_burst` jobs, refilled at `submit_rate` jobs per
  second. The buckets live in the scheduler's memory only: a restart (or another scheduler taking over) fills
  them again, which gives a user at most one more burst.

The rules are pure and `now` is a parameter. A bucket counts in millionths of a job and microseconds, in whole
numbers, so the rule is exact: however requests come, no more than `burst + rate * seconds` jobs are accepted
in any span of `seconds`. 0 for the queued limit or the rate is no limit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from libs.contracts.operations.base import CommandError
from libs.contracts.scheduling import AdminSettings
from services.scheduler.domain.state import SchedulerState

MICRO = 1_000_000  # millionths of a job in a job, microseconds in a second
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
NOTHING_CREATED = "nothing was created"


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """A user's submissions still allowed at once as of `at`: `micro` millionths of a job."""

    micro: int
    at: int  # microseconds since the epoch

    @property
    def jobs(self) -> int:
        """Whole jobs that may be submitted now."""
        return self.micro // MICRO


@dataclass(frozen=True, slots=True)
class TooFast:
    """A take refused: the whole jobs the bucket holds, and how long until it holds enough (None: never, the
    take is larger than the burst)."""

    available: int
    wait_seconds: float | None


def microseconds(now: datetime) -> int:
    """`now` as whole microseconds since the epoch (exact, unlike a float timestamp)."""
    return (now - EPOCH) // timedelta(microseconds=1)


def refilled(bucket: TokenBucket | None, now: int, rate: int, burst: int) -> TokenBucket:
    """The bucket at `now` (a user without one has a full one). A clock set back refills nothing until it
    passes the bucket's time again; a burst lowered since caps what it holds."""
    full = burst * MICRO
    if bucket is None:
        return TokenBucket(micro=full, at=now)
    if now <= bucket.at:
        return TokenBucket(micro=min(bucket.micro, full), at=bucket.at)
    # rate jobs per second is rate millionths of a job per microsecond
    return TokenBucket(micro=min(full, bucket.micro + (now - bucket.at) * rate), at=now)


def take(bucket: TokenBucket | None, count: int, now: int, rate: int, burst: int) -> TokenBucket | TooFast:
    """The bucket after `count` jobs were taken from it at `now`, or why they cannot be (rate > 0)."""
    current = refilled(bucket, now, rate, burst)
    needed = count * MICRO
    if current.micro >= needed:
        return TokenBucket(micro=current.micro - needed, at=current.at)
    if count > burst:
        return TooFast(available=current.jobs, wait_seconds=None)
    wait = -(-(needed - current.micro) // rate)  # microseconds, rounded up
    return TooFast(available=current.jobs, wait_seconds=wait / MICRO)


# --- the rules as the scheduler applies them -------------------------------------------------------------


def queued_counts(state: SchedulerState, users: Collection[str]) -> Counter[str]:
    """How many jobs each of `users` has waiting to start (status queued, in any project)."""
    return Counter(job.creator for job in state.active.values() if job.status == "queued" and job.creator in users)


def queued_limit_reachable(state: SchedulerState, adding: int, settings: AdminSettings) -> bool:
    """Whether `adding` more jobs could take any user past the queued limit: not while fewer jobs are active (a
    user's queued ones among them) than it allows with those. The common case, and then nobody's jobs are counted:
    counting goes through every active job."""
    limit = settings.max_queued_jobs_per_user
    return limit != 0 and len(state.active) + adding > limit


def _what(count: int) -> str:
    return "this job" if count == 1 else f"this array of {count} jobs"


def queued_error(user: str, queued: int, count: int, settings: AdminSettings) -> CommandError | None:
    """Refuses `count` more jobs for a user who has `queued` waiting, when that passes the limit."""
    limit = settings.max_queued_jobs_per_user
    if limit == 0 or queued + count <= limit:
        return None
    return CommandError(
        code="over-cap",
        message=f"{user} has {queued} jobs queued (all projects together); {_what(count)} would make "
        f"{queued + count}, over the limit of {limit} queued jobs per user",
        hint="wait for some of them to start, or stop queued jobs you no longer need (`trainyard list --status "
        "queued`, then `trainyard stop JOB`); an administrator can raise max_queued_jobs_per_user; "
        + NOTHING_CREATED)


def rate_taken(user: str, bucket: TokenBucket | None, count: int, now: datetime,
               settings: AdminSettings) -> TokenBucket | CommandError:
    """The user's bucket once `count` jobs are submitted at `now`, or the refusal when it holds too few."""
    rate, burst = settings.submit_rate, settings.submit_burst
    at = microseconds(now)
    if rate == 0:  # no limit: the bucket stays full, for when a limit is set again
        return TokenBucket(micro=burst * MICRO, at=at)
    taken = take(bucket, count, at, rate, burst)
    if isinstance(taken, TokenBucket):
        return taken
    limit = f"the limit is {rate} jobs per second per user, up to {burst} at once"
    if taken.wait_seconds is None:
        return CommandError(code="over-cap",
                            message=f"{_what(count)} is more than one user may submit at once ({limit})",
                            hint=f"split it into arrays of at most {burst} jobs, submitted in turn, or ask an "
                            f"administrator to raise submit_burst; {NOTHING_CREATED}")
    wait = math.ceil(taken.wait_seconds * 10) / 10
    return CommandError(code="over-cap",
                        message=f"{user} submits too fast: {_what(count)} needs {count} of the submissions allowed "
                        f"now, and {taken.available} are left ({limit})",
                        hint=f"wait {wait:g} s and submit again; {NOTHING_CREATED}")
