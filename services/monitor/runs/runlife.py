"""The life of a job's run (R1): it begins with the job's first process, later attempts continue it, and only
its primary finishes it.

The primary is rank 0: the run is finished when rank 0 of every task of the job ends well in one attempt,
or when the job ends, whichever comes first. A worker (rank > 0) that ends or crashes is recorded as that
rank's end and nothing more; so is a rank 0 that fails, since the job may be restarted or resumed, and
the next attempt continues the same run (opening it again if it was finished). The monitor records these
events (aggregate "run") from the launcher's process events and the scheduler's job ends; the rules here
are pure, and decide each event once, whatever is replayed. A run whose beginning, ends and finish are
decided together (a short job, its start reported with its exit) is recorded as one RunLived (`compacted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from libs.contracts.events import (
    EventEnvelope,
    JobDeleted,
    JobExpired,
    JobFailed,
    JobStopped,
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
from libs.contracts.operations.runs import RankEnd
from libs.eventstore import NewEvent

RankOf = tuple[int, int, int]  # attempt, task, rank
JOB_ENDS = {JobFailed: "the job failed", JobStopped: "the job was stopped",
            JobExpired: "the job expired", JobDeleted: "the job was deleted"}


@dataclass
class RunLife:
    began_at: datetime
    attempts: list[int]
    ended: dict[RankOf, RunProcessEnded] = field(default_factory=dict)
    finished: RunFinished | None = None

    @property
    def attempt(self) -> int:
        return self.attempts[-1]

    def rank_ends(self) -> list[RankEnd]:
        return [RankEnd(attempt=e.attempt, task=e.task, rank=e.rank, node=e.node, exit_code=e.exit_code,
                        ended_at=e.ended_at) for _, e in sorted(self.ended.items())]


def fold(runs: dict[str, RunLife], envelope: EventEnvelope) -> None:
    """Apply one of the monitor's run events."""
    _fold_event(runs, envelope.aggregate_id, envelope.event)


def life_after(life: RunLife | None, job_id: str, waiting: Sequence[NewEvent]) -> RunLife | None:
    """The run's life once the run events `waiting` to be recorded are (a copy: `life` is left as it is)."""
    if not waiting:
        return life
    runs = {} if life is None else {job_id: replace(life, attempts=list(life.attempts), ended=dict(life.ended))}
    for change in waiting:
        if change.aggregate_type == "run":
            _fold_event(runs, change.aggregate_id, change.event)
    return runs.get(job_id)


def _fold_event(runs: dict[str, RunLife], run_id: str, event: object) -> None:
    if isinstance(event, RunLived):  # the three kinds it stands for, in their order
        for part in (RunBegan(job_id=event.job_id, attempt=event.attempt, began_at=event.began_at), *event.ended,
                     event.finished):
            _fold_event(runs, run_id, part)
        return
    if isinstance(event, RunBegan):
        runs[event.job_id] = RunLife(began_at=event.began_at, attempts=[event.attempt])
        return
    life = runs.get(run_id)
    if life is None:
        return
    if isinstance(event, RunContinued):
        life.attempts.append(event.attempt)
        life.finished = None  # a later attempt logs on into it
    elif isinstance(event, RunProcessEnded):
        life.ended[(event.attempt, event.task, event.rank)] = event
    elif isinstance(event, RunFinished):
        life.finished = event


def _run_event(event: RunBegan | RunContinued | RunProcessEnded | RunFinished) -> NewEvent:
    return NewEvent("run", event.job_id, event)


def compacted(changes: Sequence[NewEvent]) -> list[NewEvent]:
    """`changes` with each run they wholly live (a RunBegan, its attempt's RunProcessEnded and then its RunFinished,
    nothing else of that run) as one RunLived where its RunBegan was: two events fewer to store and publish for a
    short job. Anything else of a run, and every other event, is left as it is."""
    of_run: dict[str, list[NewEvent]] = {}
    for change in changes:
        if change.aggregate_type == "run":
            of_run.setdefault(change.aggregate_id, []).append(change)
    lived = {run_id: whole for run_id, parts in of_run.items() if (whole := _lived(parts)) is not None}
    if not lived:
        return list(changes)
    kept: list[NewEvent] = []
    for change in changes:
        if change.aggregate_type != "run" or change.aggregate_id not in lived:
            kept.append(change)
        elif isinstance(change.event, RunBegan):
            kept.append(lived[change.aggregate_id])
    return kept


def _lived(parts: Sequence[NewEvent]) -> NewEvent | None:
    """One RunLived for a run's events, when they are its beginning, its attempt's rank ends, then its finish."""
    if len(parts) < 3:
        return None
    began, finished = parts[0].event, parts[-1].event
    if not isinstance(began, RunBegan) or not isinstance(finished, RunFinished) or finished.attempt != began.attempt:
        return None
    ended = [p.event for p in parts[1:-1] if isinstance(p.event, RunProcessEnded) and p.event.attempt == began.attempt]
    if len(ended) != len(parts) - 2:
        return None
    event = RunLived(job_id=began.job_id, attempt=began.attempt, began_at=began.began_at, ended=ended,
                     finished=finished)
    return NewEvent("run", parts[0].aggregate_id, event, trace=parts[0].trace)


def on_process_event(envelope: EventEnvelope, life: RunLife | None, tasks: int) -> list[NewEvent]:
    """The run events a launcher event makes: a first start begins the run, a later attempt's continues it,
    a rank's end is recorded once; the last of the attempt's rank 0s to end well finishes it. `tasks`: how
    many tasks the job has (1 unless it is a batch job)."""
    event, at = envelope.event, envelope.recorded_at
    if isinstance(event, NodeProcessStarted):
        if life is None:  # when the process started, even where that was recorded with its exit
            return [_run_event(RunBegan(job_id=event.job_id, attempt=event.attempt, began_at=event.started_at or at))]
        if event.attempt > life.attempt:
            return [_run_event(RunContinued(job_id=event.job_id, attempt=event.attempt))]
        return []
    if not isinstance(event, NodeProcessExited | NodeProcessLost) or life is None:
        return []
    key = (event.attempt, event.task, event.rank)
    if key in life.ended:
        return []
    exit_code = event.exit_code if isinstance(event, NodeProcessExited) else None
    ended_at = (event.exited_at if isinstance(event, NodeProcessExited) else None) or at
    ended = RunProcessEnded(job_id=event.job_id, attempt=event.attempt, task=event.task, rank=event.rank,
                            node=event.node, exit_code=exit_code, ended_at=ended_at)
    changes = [_run_event(ended)]
    if (event.rank == 0 and life.finished is None and event.attempt == life.attempt
            and _primaries_done(life, ended, tasks)):  # only a primary's end finishes it
        changes.append(_run_event(RunFinished(job_id=event.job_id, attempt=event.attempt, by=_primary_end(tasks),
                                               finished_at=ended_at)))
    return changes


def _primaries_done(life: RunLife, ended: RunProcessEnded, tasks: int) -> bool:
    """Whether, with `ended`, rank 0 of every task of its attempt ended well."""
    ends = {**life.ended, (ended.attempt, ended.task, ended.rank): ended}
    return all((end := ends.get((ended.attempt, task, 0))) is not None and end.exit_code == 0 for task in range(tasks))


def _primary_end(tasks: int) -> str:
    return "rank 0 ended" if tasks == 1 else f"rank 0 of each of the {tasks} tasks ended"


def on_job_event(envelope: EventEnvelope, life: RunLife | None, tasks: int) -> list[NewEvent]:
    """The job's end finishes its run, if it began and its primary has not finished it. A job that succeeded
    had every rank 0 end well, whichever of the two the monitor hears of first: its primary finished it."""
    event = envelope.event
    by = _primary_end(tasks) if isinstance(event, JobSucceeded) else JOB_ENDS.get(type(event))
    if by is None or life is None or life.finished is not None:
        return []
    return [_run_event(RunFinished(job_id=envelope.aggregate_id, attempt=life.attempt, by=by,
                                   finished_at=envelope.recorded_at))]
