"""Per-user limits on creating jobs (services/scheduler/domain/limits.py): queued jobs per user, every project
together, and a token bucket of submissions per second. The bucket never lets through more than its burst
and its refill in any span of time, tells a refused user how long to wait, and refills nothing when the
clock goes back; a batch counts what it accepted earlier, and takes nothing from a refused user's bucket."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JobAccepted
from libs.contracts.scheduling import AdminSettings
from services.scheduler.domain.limits import (
    MICRO,
    TokenBucket,
    TooFast,
    microseconds,
    queued_counts,
    queued_error,
    queued_limit_reachable,
    rate_taken,
    take,
)
from services.scheduler.rules.submissions import Submission, decide
from tests.support.scheduler_state import Fold
from tests.support.strategies import SETTINGS

NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)
ALICE = Identity(user="alice", projects=["default", "vision"])
BOB = Identity(user="bob", projects=["default"])

# A request: (microseconds after the previous one, jobs it asks for).
requests = st.lists(st.tuples(st.integers(0, 3 * MICRO), st.integers(1, 12)), max_size=60)
rates, bursts = st.integers(1, 50), st.integers(1, 40)


def played(rate: int, burst: int, steps: list[tuple[int, int]]) -> list[tuple[int, int, TokenBucket | TooFast]]:
    """Each request's time, its count and the bucket's answer, one after the other from a full bucket."""
    bucket: TokenBucket | None = None
    now = 0
    answers = []
    for gap, count in steps:
        now += gap
        answer = take(bucket, count, now, rate, burst)
        if isinstance(answer, TokenBucket):
            bucket = answer
        answers.append((now, count, answer))
    return answers


# --- the bucket ----------------------------------------------------------------------------------------------


@SETTINGS
@given(rates, bursts, requests)
def test_no_span_of_time_accepts_more_than_the_burst_and_the_refill(rate: int, burst: int,
                                                                       steps: list[tuple[int, int]]) -> None:
    accepted = [(now, count) for now, count, answer in played(rate, burst, steps) if isinstance(answer, TokenBucket)]
    for first, (start, _) in enumerate(accepted):
        total = 0
        for end, count in accepted[first:]:
            total += count
            # in whole millionths, exactly: jobs * 1e6 <= burst * 1e6 + rate * microseconds
            assert total * MICRO <= burst * MICRO + rate * (end - start)


@SETTINGS
@given(rates, bursts, requests)
def test_a_refused_take_is_told_exactly_how_long_to_wait(rate: int, burst: int, steps: list[tuple[int, int]]) -> None:
    bucket: TokenBucket | None = None
    now = 0
    for gap, count in steps:
        now += gap
        answer = take(bucket, count, now, rate, burst)
        if isinstance(answer, TokenBucket):
            bucket = answer
            continue
        assert answer.available < count
        if count > burst:
            assert answer.wait_seconds is None  # never at once: it is told to split
            continue
        assert answer.wait_seconds is not None
        wait = round(answer.wait_seconds * MICRO)
        assert isinstance(take(bucket, count, now + wait, rate, burst), TokenBucket)
        assert isinstance(take(bucket, count, now + wait - 1, rate, burst), TooFast)


def test_a_full_bucket_takes_its_burst_at_once_and_then_one_job_per_refill() -> None:
    burst = take(None, 5, 0, 2, 5)
    assert burst == TokenBucket(micro=0, at=0)
    assert take(burst, 1, 0, 2, 5) == TooFast(available=0, wait_seconds=0.5)
    assert isinstance(take(burst, 1, MICRO // 2, 2, 5), TokenBucket)
    assert take(None, 6, 0, 2, 5) == TooFast(available=5, wait_seconds=None)


def test_a_clock_set_back_refills_nothing_and_a_lowered_burst_caps_the_bucket() -> None:
    emptied = take(None, 3, 10 * MICRO, 1, 3)
    assert isinstance(emptied, TokenBucket)
    assert take(emptied, 1, 0, 1, 3) == TooFast(available=0, wait_seconds=1.0)  # counted from its own time
    assert take(emptied, 1, 11 * MICRO, 1, 3) == TokenBucket(micro=0, at=11 * MICRO)
    assert take(TokenBucket(micro=3 * MICRO, at=0), 2, 0, 1, 1) == TooFast(available=1, wait_seconds=None)


def test_microseconds_are_exact() -> None:
    assert microseconds(NOW + timedelta(microseconds=1)) - microseconds(NOW) == 1


# --- the rules as the scheduler applies them ------------------------------------------------------------------


def test_jobs_are_counted_only_when_the_queued_limit_could_be_passed() -> None:
    fold = Fold()
    fold.job("job-000000000001", "a", ["cpu-4"])
    fold.job("job-000000000002", "b", ["cpu-4"], project="vision")
    limit = AdminSettings(max_queued_jobs_per_user=3)
    assert not queued_limit_reachable(fold.state, 1, limit)  # 2 active + 1: nobody can pass 3
    assert queued_error("alice", queued_counts(fold.state, {"alice"})["alice"], 1, limit) is None
    assert queued_limit_reachable(fold.state, 2, limit)  # 2 + 2: alice could
    assert queued_error("alice", queued_counts(fold.state, {"alice"})["alice"], 2, limit) is not None
    assert not queued_limit_reachable(fold.state, 10**6, AdminSettings(max_queued_jobs_per_user=0))  # no limit


def test_the_queued_limit_counts_the_users_queued_jobs_in_every_project_and_names_them() -> None:
    fold = Fold()
    fold.job("job-000000000001", "a", ["cpu-4"])
    fold.job("job-000000000002", "b", ["cpu-4"], project="vision")
    fold.job("job-000000000003", "c", ["cpu-4"])
    fold.admit("job-000000000003", "cpu-4", ["node-1"])  # running: no longer waiting
    assert queued_counts(fold.state, {"alice", "bob"}) == {"alice": 2}
    settings = AdminSettings(max_queued_jobs_per_user=3)
    assert queued_error("alice", 2, 1, settings) is None
    error = queued_error("alice", 2, 2, settings)
    assert error is not None and error.code == "over-cap"
    assert "alice has 2 jobs queued" in error.message and "this array of 2 jobs would make 4" in error.message
    assert "limit of 3" in error.message
    assert "trainyard stop" in (error.hint or "") and "nothing was created" in (error.hint or "")
    assert queued_error("alice", 10**6, 10_000, AdminSettings(max_queued_jobs_per_user=0)) is None


def test_a_user_submitting_too_fast_is_told_the_limit_what_is_left_and_how_long_to_wait() -> None:
    settings = AdminSettings(submit_rate=2, submit_burst=3)
    bucket = rate_taken("alice", None, 3, NOW, settings)
    assert isinstance(bucket, TokenBucket)
    error = rate_taken("alice", bucket, 2, NOW, settings)
    assert isinstance(error, CommandError) and error.code == "over-cap"
    assert "alice submits too fast" in error.message and "0 are left" in error.message
    assert "2 jobs per second per user, up to 3 at once" in error.message
    assert error.hint == "wait 1 s and submit again; nothing was created"
    too_big = rate_taken("alice", None, 4, NOW, settings)
    assert isinstance(too_big, CommandError) and "split it into arrays of at most 3 jobs" in (too_big.hint or "")
    # No rate: nothing is refused, and the bucket is full for when a limit is set again.
    unlimited = rate_taken("alice", bucket, 10**6, NOW, AdminSettings(submit_rate=0, submit_burst=3))
    assert unlimited == TokenBucket(micro=3 * MICRO, at=microseconds(NOW))


def submission(job_id: str, who: Identity = ALICE, at: datetime | None = NOW) -> Submission:
    spec = JobSpec(name="j", flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"), command="python3 t.py",
                   output=OutputRef(name="o"))
    return Submission(job_id=job_id, spec=spec, identity=who, at=at)


def test_a_batch_counts_the_jobs_it_accepted_and_refuses_only_the_user_over_the_limit() -> None:
    fold = Fold()
    fold.state.settings = AdminSettings(max_queued_jobs_per_user=3)
    fold.job("job-000000000001", "queued", ["cpu-4"], project="vision")
    batch = [submission(f"job-00000000000{i}") for i in "abc"] + [submission("job-00000000000d", who=BOB)]
    decided = decide(fold.state, batch, {})
    assert [isinstance(a, JobAccepted) for a in decided.answers] == [True, True, False, True]
    refused = decided.answers[2]
    assert isinstance(refused, CommandError) and "alice has 3 jobs queued" in refused.message
    assert [change.aggregate_id for change in decided.changes] == ["job-00000000000a", "job-00000000000b",
                                                                    "job-00000000000d"]


def test_a_batch_takes_from_the_buckets_of_the_accepted_only() -> None:
    fold = Fold()
    fold.state.settings = AdminSettings(submit_rate=1, submit_burst=2)
    emptied = TokenBucket(micro=0, at=microseconds(NOW))
    batch = [submission("job-00000000000a", who=BOB), submission("job-00000000000b"),
             submission("job-00000000000c"), submission("job-00000000000d")]
    decided = decide(fold.state, batch, {"bob": emptied})
    assert [isinstance(a, JobAccepted) for a in decided.answers] == [False, True, True, False]
    assert decided.buckets == {"alice": emptied}  # bob took nothing: his bucket is as it was
    later = [replace(s, at=NOW + timedelta(seconds=1)) for s in batch[:1]]
    assert isinstance(decide(fold.state, later, {"bob": emptied}).answers[0], JobAccepted)
