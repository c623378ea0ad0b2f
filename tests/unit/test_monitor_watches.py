"""The monitor's watches (`services/monitor/watches.py`): who is pushed what about which job, and until when."""

from __future__ import annotations

from libs.contracts.ids import new_job_id
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.watches import WATCH_SECONDS, WatchJob
from services.monitor.watches import Watches

INBOX = "_INBOX.users.user-alice.abc"


def asked(job_id: str, inbox: str = INBOX, **changes: bool) -> WatchJob:
    return WatchJob(job_id=job_id, inbox=inbox, **changes)


def test_a_watch_stands_until_it_runs_out_unless_renewed() -> None:
    watches, job = Watches(), new_job_id()
    assert watches.ask(asked(job), "alice", now=0.0) is True  # new
    assert watches.ask(asked(job, logs=True), "alice", now=WATCH_SECONDS - 1) is False  # renewed, now with logs
    watches.sweep(WATCH_SECONDS + 1)
    assert [w.inbox for w in watches.of(job)] == [INBOX] and watches.logs_watched(job)
    watches.sweep(2 * WATCH_SECONDS)
    assert watches.of(job) == [] and len(watches) == 0 and not watches.per_user


def test_ending_a_watch_stops_it_at_once_and_forgets_the_jobs_log_position() -> None:
    watches, job = Watches(), new_job_id()
    watches.ask(asked(job, logs=True), "alice", now=0.0)
    assert watches.saw_log(job, 5) is None
    assert watches.saw_log(job, 9) == 5
    assert watches.ask(asked(job, end=True), "alice", now=1.0) is False
    assert watches.of(job) == [] and job not in watches.last_log
    assert watches.ask(asked(job, end=True), "alice", now=1.0) is True  # ending what does not stand is no error


def test_each_chunk_names_the_one_seen_before_it_and_a_redelivered_one_changes_nothing() -> None:
    watches, job = Watches(), new_job_id()
    watches.ask(asked(job, logs=True), "alice", now=0.0)
    assert [watches.saw_log(job, position) for position in (3, 7, 7, 4, 12)] == [None, 3, 7, 7, 7]


def test_a_person_holds_a_bounded_number_of_watches_and_nobody_takes_over_anothers_inbox() -> None:
    watches, job = Watches(most_per_user=2, most=3), new_job_id()
    assert watches.ask(asked(job, "_INBOX.users.user-alice.a"), "alice", 0.0) is True
    assert watches.ask(asked(job, "_INBOX.users.user-alice.b"), "alice", 0.0) is True
    over = watches.ask(asked(job, "_INBOX.users.user-alice.c"), "alice", 0.0)
    assert isinstance(over, CommandError) and over.code == "over-cap"
    assert watches.ask(asked(job, "_INBOX.users.user-alice.a"), "alice", 1.0) is False  # a renewal is no new one
    assert watches.ask(asked(job, "_INBOX.users.user-bob.a"), "bob", 0.0) is True
    full = watches.ask(asked(job, "_INBOX.users.user-carol.a"), "carol", 0.0)
    assert isinstance(full, CommandError) and full.code == "over-cap"
    taken = watches.ask(asked(job, "_INBOX.users.user-alice.a", end=True), "bob", 0.0)
    assert isinstance(taken, CommandError) and taken.code == "forbidden"
    assert len(watches) == 3


def test_a_deleted_jobs_watches_are_forgotten() -> None:
    watches, job, other = Watches(), new_job_id(), new_job_id()
    watches.ask(asked(job, logs=True), "alice", 0.0)
    watches.ask(asked(other), "alice", 0.0)
    watches.forget(job)
    assert watches.of(job) == [] and [w.job_id for w in watches.of(other)] == [other]
    assert watches.per_user["alice"] == 1
