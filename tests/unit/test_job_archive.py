"""Ended jobs leave the scheduler's state after the administrator's retention (JobArchived), oldest first; a job whose
debug environment is kept, and an array with a job not yet ended, stay."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from libs.contracts.arrays import ArrayMember
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import (
    ArraySubmitted,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    EventEnvelope,
    JobArchived,
    JobFailed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    SettingsChanged,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.scheduling import AdminSettings
from services.scheduler.history.past import PastScheduler
from services.scheduler.rules.archive import archivals
from services.scheduler.service import Scheduler
from tests.support.eventlog import EventLog, fake_runtime
from tests.support.placement import CPU4
from tests.support.scheduler_state import AT, Fold

DAY = timedelta(days=1)


class TimedFold(Fold):
    """A fold whose events are recorded at `self.now`."""

    def __init__(self) -> None:
        super().__init__()
        self.now = AT

    def apply(self, event: Any, service: str = "scheduler", aggregate: str = "x") -> None:
        self.position += 1
        self.state.apply(EventEnvelope(event_id=str(self.position), service=service, aggregate_type="job",
                                       aggregate_id=aggregate, version=self.position, position=self.position,
                                       recorded_at=self.now, event=event))

    def archive_due(self, after: timedelta, **options: Any) -> list[str]:
        """The jobs archived `after` the latest event, folded in."""
        changes = archivals(self.state, self.now + after, **options)
        for change in changes:
            self.apply(change.event, aggregate=change.aggregate_id)
        return [change.aggregate_id for change in changes]


def ended_job(fold: TimedFold, job_id: str, **extra: Any) -> None:
    fold.job(job_id, job_id, ["cpu-4"], **extra)
    fold.node("n1")
    fold.admit(job_id, "cpu-4", ["n1"])
    fold.apply(JobSucceeded(job_id=job_id), aggregate=job_id)


def test_an_ended_job_leaves_after_the_retention_and_is_still_counted() -> None:
    fold = TimedFold()
    ended_job(fold, "job-old")
    fold.job("job-queued", "queued", ["cpu-4"])
    assert fold.archive_due(7 * DAY - timedelta(seconds=1)) == []  # the default retention: a week
    assert fold.archive_due(7 * DAY) == ["job-old"]
    state = fold.state
    assert "job-old" not in state.jobs and "job-old" not in state.active
    assert list(state.ended_in_order()) == []
    assert [job.job_id for job in state.queue()] == ["job-queued"]  # the queue is untouched
    assert state.status_counts()["succeeded"] == 1  # the per-status counts keep every job there ever was
    assert fold.archive_due(30 * DAY) == []  # once only


def test_the_retention_is_the_administrators_and_the_oldest_leave_first() -> None:
    fold = TimedFold()
    fold.apply(SettingsChanged(settings=AdminSettings(job_retention="1h"), by="root"), aggregate="platform")
    for index in range(5):
        ended_job(fold, f"job-{index}")
        fold.now += timedelta(minutes=1)
    assert fold.archive_due(timedelta(minutes=57), limit=2) == ["job-0", "job-1"]
    assert fold.archive_due(timedelta(minutes=57)) == ["job-2"]  # 60 minutes after its end, not yet the others'
    archived = fold.archive_due(timedelta(hours=2))
    assert archived == ["job-3", "job-4"]
    assert fold.state.jobs == {}


def test_a_retention_below_a_minute_counts_as_a_minute() -> None:
    fold = TimedFold()
    fold.apply(SettingsChanged(settings=AdminSettings(job_retention="1s"), by="root"), aggregate="platform")
    ended_job(fold, "job-a")
    assert fold.archive_due(timedelta(seconds=30)) == []
    assert fold.archive_due(timedelta(seconds=60)) == ["job-a"]


def test_a_job_whose_debug_environment_is_kept_stays_until_it_is_released() -> None:
    fold = TimedFold()
    fold.job("job-debug", "debug", ["cpu-4"])
    fold.node("n1")
    fold.admit("job-debug", "cpu-4", ["n1"])
    fold.apply(JobFailed(job_id="job-debug", reason="exit 1", exit_code=1), aggregate="job-debug")
    fold.apply(DebugEnvironmentKept(job_id="job-debug", attempt=1, nodes=["n1"], until=fold.now + 30 * DAY),
               service="monitor", aggregate="job-debug")
    assert fold.archive_due(8 * DAY) == []
    fold.apply(DebugEnvironmentReleased(job_id="job-debug", attempt=1),
               service="monitor", aggregate="job-debug")
    assert fold.archive_due(8 * DAY) == ["job-debug"]


def test_an_array_leaves_at_once_when_all_of_its_jobs_may() -> None:
    fold = TimedFold()
    fold.node("n1")
    fold.apply(ArraySubmitted(array_id="array-1", job_name="member-{index}", project="p", creator="alice",
                              indices="0-2", size=3), aggregate="array-1")
    for index in range(3):
        spec = JobSpec(name=f"member-{index}", flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"),
                       command="true", output=OutputRef(name="o"))
        fold.apply(JobSubmitted(job_id=f"job-{index}", spec=spec, creator="alice",
                                array=ArrayMember(array_id="array-1", index=index)), aggregate=f"job-{index}")
    for index in range(2):
        fold.admit(f"job-{index}", "cpu-4", ["n1"])
        fold.apply(JobSucceeded(job_id=f"job-{index}"), aggregate=f"job-{index}")
    assert fold.archive_due(30 * DAY) == []  # job-2 has not even started
    fold.now += 20 * DAY
    fold.admit("job-2", "cpu-4", ["n1"])
    fold.apply(JobSucceeded(job_id="job-2"), aggregate="job-2")
    assert fold.archive_due(6 * DAY) == []  # the last one ended 6 days ago
    assert fold.archive_due(7 * DAY, limit=1) == ["job-0", "job-1", "job-2"]  # together, whatever the limit
    assert fold.state.arrays == {} and fold.state.jobs == {}


def test_archived_is_recorded_with_the_retention_it_was_kept_for() -> None:
    fold = TimedFold()
    ended_job(fold, "job-a")
    changes = archivals(fold.state, fold.now + 8 * DAY)
    assert [change.event for change in changes] == [JobArchived(job_id="job-a", retention="7d")]


def test_the_scheduler_notes_where_the_other_services_events_about_a_job_are_stored() -> None:
    """Event subjects name no job: the scheduler notes the stream sequence of each event of another service about a
    job it holds (its launches', the monitor's about it), by which its history is read back."""
    fold = TimedFold()
    ended_job(fold, "job-a")
    ended_job(fold, "job-b")

    def stored(sequence: int, service: str, aggregate_type: str, job_id: str) -> None:
        event = DebugEnvironmentReleased(job_id=job_id, attempt=1)
        fold.state.stored_at(EventEnvelope(event_id=str(sequence), service=service, aggregate_type=aggregate_type,
                                           aggregate_id=job_id, version=1, position=sequence, recorded_at=fold.now,
                                           event=event), sequence)

    stored(7, "launcher", "launch", "job-a")
    stored(9, "monitor", "job", "job-a")
    stored(9, "monitor", "job", "job-a")  # folded again (a replay): noted once
    stored(11, "launcher", "launch", "job-b")
    stored(12, "monitor", "run", "job-a")  # its run: not part of its history here (`trainyard metrics`)
    stored(13, "launcher", "launch", "job-never")
    stored(0, "launcher", "launch", "job-a")  # not delivered from the stream: nowhere to read it back
    assert (fold.state.jobs["job-a"].published, fold.state.jobs["job-b"].published) == ([7, 9], [11])


def test_an_archived_job_and_its_array_leave_the_versions_a_scheduler_records_at() -> None:
    """A scheduler notes the version of every aggregate it records to; an archived job's goes with the job (and an
    array's with its last job), in the live scheduler and in the states of past instants it restores at a start,
    so that a scheduler that runs for months holds none of the jobs that left."""
    log = EventLog()
    live = Scheduler(fake_runtime(log, "scheduler"), ClusterConfig(flavors=[CPU4]))
    past = PastScheduler(ClusterConfig(flavors=[CPU4]))
    spec = JobSpec(name="member-{index}", flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"), command="true",
                   output=OutputRef(name="o"))
    recorded = [log.record("scheduler", "array", "array-1", ArraySubmitted(
        array_id="array-1", job_name="member-{index}", project="p", creator="alice", indices="0-1", size=2))]
    for index in range(2):
        recorded.append(log.record("scheduler", "job", f"job-{index}", JobSubmitted(
            job_id=f"job-{index}", spec=spec, creator="alice", array=ArrayMember(array_id="array-1", index=index))))
        recorded.append(log.record("scheduler", "job", f"job-{index}", JobStopped(job_id=f"job-{index}", by="alice")))
    recorded.append(log.record("scheduler", "job", "job-0", JobArchived(job_id="job-0", retention="1m")))
    for envelope in recorded:
        live.apply(envelope)
        past.fold(envelope)
    assert set(live.versions) == set(past.versions) == {("array", "array-1"), ("job", "job-1")}
    last = log.record("scheduler", "job", "job-1", JobArchived(job_id="job-1", retention="1m"))
    live.apply(last)
    past.fold(last)
    assert live.versions == past.versions == {}
