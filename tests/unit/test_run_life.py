"""R1: a run begins with the job's first process, later attempts continue it, and only its primary (rank 0 of
every task, or the job's end) finishes it; each event is decided once, whatever is replayed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from libs.contracts.events import (
    JobFailed,
    JobSucceeded,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    RunBegan,
    RunContinued,
    RunFinished,
    RunLived,
    RunProcessEnded,
)
from services.monitor.runs import runlife
from services.monitor.runs.runlife import RunLife
from tests.support.eventlog import T0, EventLog
from tests.support.strategies import SETTINGS

JOB = "job-000000000001"


class Runs:
    """The monitor's rules and fold over a shared log: the launcher's and scheduler's events in, runs out."""

    def __init__(self, tasks: int = 1) -> None:
        self.log = EventLog()
        self.lives: dict[str, RunLife] = {}
        self.tasks = tasks

    def launcher(self, event: Any) -> list[Any]:
        envelope = self.log.record("launcher", "launch", JOB, event)
        return self._record(runlife.on_process_event(envelope, self.lives.get(JOB), self.tasks))

    def scheduler(self, event: Any) -> list[Any]:
        envelope = self.log.record("scheduler", "job", JOB, event)
        return self._record(runlife.on_job_event(envelope, self.lives.get(JOB), self.tasks))

    def _record(self, changes: list[Any]) -> list[Any]:
        for change in changes:
            envelope = self.log.record("monitor", change.aggregate_type, change.aggregate_id, change.event)
            runlife.fold(self.lives, envelope)
        return [change.event for change in changes]

    @property
    def life(self) -> RunLife:
        return self.lives[JOB]


def started(attempt: int, rank: int, task: int = 0) -> NodeProcessStarted:
    return NodeProcessStarted(job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", pid=100 + rank, task=task)


def exited(attempt: int, rank: int, code: int, task: int = 0) -> NodeProcessExited:
    return NodeProcessExited(job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", exit_code=code, task=task)


def test_the_first_process_begins_the_run_and_the_other_ranks_join_it() -> None:
    runs = Runs()
    assert [type(e) for e in runs.launcher(started(1, 0))] == [RunBegan]
    assert runs.launcher(started(1, 1)) == []
    assert runs.life.attempts == [1] and runs.life.finished is None


def test_a_run_begins_when_its_process_started_even_where_that_was_recorded_with_its_end() -> None:
    runs = Runs()
    began = runs.log.now - timedelta(seconds=2)  # by the node's clock; recorded with the exit, later
    [run] = runs.launcher(msgspec.structs.replace(started(1, 0), started_at=began))
    assert isinstance(run, RunBegan) and run.began_at == began and runs.life.began_at == began
    unknown = Runs()
    [run] = unknown.launcher(started(1, 0))  # from an older agent: when it was recorded
    assert isinstance(run, RunBegan) and run.began_at == unknown.log.envelopes[0].recorded_at


def test_a_worker_that_crashes_does_not_finish_the_run_and_the_restart_continues_it() -> None:
    runs = Runs()
    runs.launcher(started(1, 0))
    runs.launcher(started(1, 1))
    [ended] = runs.launcher(exited(1, 1, -9))  # rank 1 killed
    assert isinstance(ended, RunProcessEnded) and ended.rank == 1 and ended.exit_code == -9
    [stopped] = runs.launcher(exited(1, 0, 143))  # rank 0 stopped with its attempt: not the primary's end
    assert isinstance(stopped, RunProcessEnded) and runs.life.finished is None
    [continued] = runs.launcher(started(2, 0))
    assert isinstance(continued, RunContinued) and runs.life.attempts == [1, 2]
    runs.launcher(started(2, 1))
    runs.launcher(exited(2, 1, 0))
    assert runs.life.finished is None  # a worker that ends well does not finish it either
    *_, finished = runs.launcher(exited(2, 0, 0))
    assert isinstance(finished, RunFinished) and finished.by == "rank 0 ended" and finished.attempt == 2
    assert runs.scheduler(JobSucceeded(job_id=JOB)) == []  # finished once


def test_a_job_that_succeeded_was_finished_by_its_primary_whichever_the_monitor_hears_of_first() -> None:
    runs = Runs(tasks=2)
    runs.launcher(started(1, 0, task=0))
    runs.launcher(started(1, 0, task=1))
    [finished] = runs.scheduler(JobSucceeded(job_id=JOB))  # before the launcher's exits reached the monitor
    assert isinstance(finished, RunFinished) and finished.by == "rank 0 of each of the 2 tasks ended"
    assert [type(e) for e in runs.launcher(exited(1, 0, 0, task=0))] == [RunProcessEnded]
    assert [type(e) for e in runs.launcher(exited(1, 0, 0, task=1))] == [RunProcessEnded]  # finished once


def test_the_job_ending_finishes_a_run_its_primary_did_not() -> None:
    runs = Runs()
    runs.launcher(started(1, 0))
    runs.launcher(exited(1, 0, 1))
    [finished] = runs.scheduler(JobFailed(job_id=JOB, reason="rank 0 exited with 1"))
    assert isinstance(finished, RunFinished) and finished.by == "the job failed"


def test_a_job_that_never_started_has_no_run_to_finish() -> None:
    runs = Runs()
    assert runs.scheduler(JobFailed(job_id=JOB, reason="no node fits")) == []
    assert JOB not in runs.lives


def test_a_batch_job_s_run_finishes_when_rank_0_of_every_task_ended_well() -> None:
    runs = Runs(tasks=3)
    for task in range(3):
        runs.launcher(started(1, 0, task=task))
    runs.launcher(exited(1, 0, 0, task=0))
    runs.launcher(exited(1, 0, 0, task=2))
    assert runs.life.finished is None
    *_, finished = runs.launcher(exited(1, 0, 0, task=1))
    assert isinstance(finished, RunFinished) and finished.by == "rank 0 of each of the 3 tasks ended"


def test_a_late_end_of_an_earlier_attempt_does_not_finish_the_run_a_later_attempt_continues() -> None:
    runs = Runs()
    runs.launcher(started(1, 0))
    runs.launcher(started(1, 1))
    [lost] = runs.launcher(NodeProcessLost(job_id=JOB, attempt=1, rank=1, node="n1", reason="node lost"))
    assert isinstance(lost, RunProcessEnded) and lost.exit_code is None
    runs.launcher(started(2, 0))  # resumed elsewhere
    [ended] = runs.launcher(exited(1, 0, 0))  # attempt 1's rank 0 ending well once stopped: not attempt 2's end
    assert isinstance(ended, RunProcessEnded) and ended.attempt == 1 and runs.life.finished is None
    assert runs.launcher(exited(1, 0, 0)) == []  # heard of again: recorded once


def test_a_later_attempt_opens_a_finished_run_again() -> None:
    runs = Runs()
    runs.launcher(started(1, 0))
    runs.launcher(exited(1, 0, 0))
    assert runs.life.finished is not None
    runs.launcher(started(2, 0))  # a worker failed after rank 0 ended, and the job was restarted
    assert runs.life.finished is None and runs.life.attempts == [1, 2]


Step = tuple[str, int, int, int]  # what, attempt, rank, exit code

steps = st.lists(st.tuples(st.sampled_from(["start", "exit", "lost"]), st.integers(1, 3), st.integers(0, 2),
                           st.sampled_from([0, 1, -9])), max_size=30)


@SETTINGS
@example([("start", 1, 0, 0), ("exit", 2, 0, 0), ("start", 2, 0, 0), ("exit", 2, 1, 0)])  # ends heard out of order
@given(steps)
def test_every_event_is_decided_once_and_only_a_primary_or_the_job_finishes_the_run(plan: list[Step]) -> None:
    runs = Runs()
    for what, attempt, rank, code in plan:
        event: Any = (started(attempt, rank) if what == "start" else exited(attempt, rank, code) if what == "exit"
                      else NodeProcessLost(job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", reason="lost"))
        recorded = runs.launcher(event)
        for change in recorded:
            if isinstance(change, RunFinished):
                assert what == "exit" and rank == 0 and code == 0 and attempt == runs.life.attempt
        # The same event again (a replay, a redelivery) records nothing more.
        envelope = runs.log.envelopes[-1 - len(recorded)]
        assert runlife.on_process_event(envelope, runs.lives.get(JOB), 1) == []
    if JOB in runs.lives:
        assert runs.life.attempts == sorted(set(runs.life.attempts))


def launcher_event(what: str, attempt: int, rank: int, code: int) -> Any:
    return (started(attempt, rank) if what == "start" else exited(attempt, rank, code) if what == "exit"
            else NodeProcessLost(job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", reason="lost"))


def launcher_envelope(runs: Runs, index: int, step: Step) -> Any:
    """The launcher's `index`th event of a plan, recorded at a time of its own whatever else the log holds."""
    envelope = runs.log.record("launcher", "launch", JOB, launcher_event(*step))
    return msgspec.structs.replace(envelope, recorded_at=T0 + timedelta(minutes=index))


@SETTINGS
@example([("start", 1, 0, 0), ("exit", 1, 0, 0)], [2])  # a short job's start and end arrive together
@given(steps, st.lists(st.integers(1, 5), max_size=10))
def test_events_decided_together_before_any_is_recorded_are_decided_as_one_by_one(plan: list[Step],
                                                                                 cuts: list[int]) -> None:
    """The monitor decides the launcher events that arrive together in one append, each after the run events
    waiting for its job (`life_after`): the same run events as when each was recorded before the next."""
    one_by_one = Runs()
    expected = [event for index, step in enumerate(plan) for event in one_by_one._record(
        runlife.on_process_event(launcher_envelope(one_by_one, index, step), one_by_one.lives.get(JOB), 1))]
    together = Runs()
    decided: list[Any] = []
    index = 0
    for size in [*cuts, len(plan)]:
        run = plan[index:index + size]
        before = together.lives.get(JOB)
        snapshot = None if before is None else (list(before.attempts), dict(before.ended), before.finished)
        waiting: list[Any] = []
        for step in run:
            envelope = launcher_envelope(together, index, step)
            waiting += runlife.on_process_event(envelope, runlife.life_after(before, JOB, waiting), 1)
            index += 1
        if before is not None:  # the recorded life is left as it was until the run's events are recorded
            assert (before.attempts, before.ended, before.finished) == snapshot
        decided += together._record(waiting)
    assert decided == expected


def test_a_short_job_s_run_is_recorded_as_one_event_that_folds_as_its_three() -> None:
    plain, compact = Runs(), Runs()
    for runs, squeeze in ((plain, False), (compact, True)):
        waiting: list[Any] = []
        for index, step in enumerate([("start", 1, 0, 0), ("exit", 1, 0, 0)]):
            waiting += runlife.on_process_event(launcher_envelope(runs, index, step),
                                                runlife.life_after(None, JOB, waiting), 1)
        recorded = runs._record(runlife.compacted(waiting) if squeeze else waiting)
        assert [type(e) for e in recorded] == ([RunLived] if squeeze else [RunBegan, RunProcessEnded, RunFinished])
    assert compact.life == plain.life and compact.life.finished is not None
    assert compact.life.finished.by == "rank 0 ended" and compact.life.rank_ends() == plain.life.rank_ends()


@SETTINGS
@example([("start", 1, 0, 0), ("exit", 1, 0, 0)], [2])
@example([("start", 1, 0, 0), ("exit", 1, 1, 1), ("exit", 1, 0, 0), ("start", 2, 0, 0)], [4])
@given(steps, st.lists(st.integers(1, 5), max_size=10))
def test_runs_recorded_compacted_fold_as_runs_recorded_event_by_event(plan: list[Step], cuts: list[int]) -> None:
    """Whatever arrives together, a run lived whole in one append folds as its parts would: the same life."""
    plain, compact = Runs(), Runs()
    index = 0
    for size in [*cuts, len(plan)]:
        run = plan[index:index + size]
        for runs, squeeze in ((plain, False), (compact, True)):
            before = runs.lives.get(JOB)
            waiting: list[Any] = []
            for offset, step in enumerate(run):
                envelope = launcher_envelope(runs, index + offset, step)
                waiting += runlife.on_process_event(envelope, runlife.life_after(before, JOB, waiting), 1)
            kept = runlife.compacted(waiting) if squeeze else waiting
            assert len(kept) <= len(waiting)
            runs._record(kept)
        index += len(run)
    assert compact.lives == plain.lives
