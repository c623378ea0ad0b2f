"""Runs (SPEC R1, R2): the monitor answers for every job's run, read from the metrics its nodes' agents
publish.

`TRAINYARD_METRICS` is the store: the monitor keeps no copy of the points, and reads a job's batches on
demand, with a pull consumer on the job's own subject, folding them into each series' count, last,
least and greatest values (a series is a name logged by one rank of one task) and the run's configuration
and summary. A point is taken once: each process numbers its lines, and a line published again (after an
agent restart) is dropped by its number. An archived job's run is read the same way: its record and its run's
life are read back from the events stream (`archive`), its points are still in the metrics stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
from nats.js.client import JetStreamContext

from libs.contracts import subjects
from libs.contracts.codec import decode
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import (
    GET_RUN,
    GET_SERIES,
    GetRun,
    GetSeries,
    ProcessView,
    RunView,
    SeriesPage,
    SeriesPoint,
    SeriesView,
)
from libs.contracts.runs import MetricBatch, MetricPoint
from libs.jobstatus import JobLifecycle, JobRecord
from libs.messaging.reader import read_pulled, stream_sequence
from libs.messaging.responder import Route
from services.monitor.runs.archive import PastJobs, events_unavailable, job_to_answer
from services.monitor.runs.runlife import RunLife

ProcessKey = tuple[int, int, int, str]  # attempt, task, rank, process
SeriesKey = tuple[str, int, int]  # name, task, rank


@dataclass
class SeriesStats:
    count: int
    last: float
    least: float
    greatest: float
    last_step: int | None
    last_at: datetime

    def add(self, point: MetricPoint) -> None:
        self.count += 1
        self.last, self.last_step, self.last_at = point.value, point.step, point.at
        self.least, self.greatest = min(self.least, point.value), max(self.greatest, point.value)


@dataclass
class ProcessRecord:
    node: str
    points: int = 0
    finished_at: datetime | None = None


@dataclass
class RunRecord:
    series: dict[SeriesKey, SeriesStats] = field(default_factory=dict)
    processes: dict[ProcessKey, ProcessRecord] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    taken: dict[ProcessKey, int] = field(default_factory=dict)  # each process's last line taken


def fresh(taken: dict[ProcessKey, int], batch: MetricBatch) -> list[MetricPoint]:
    """The batch's points not taken before (by their line numbers), and note them taken."""
    key = (batch.attempt, batch.task, batch.rank, batch.process)
    last = taken.get(key, 0)
    points = [point for point in batch.points if point.seq > last]
    seqs = [point.seq for point in batch.points]
    if seqs:
        taken[key] = max(last, *seqs)
    return points


@dataclass
class RunIndex:
    runs: dict[str, RunRecord] = field(default_factory=dict)

    def fold(self, batch: MetricBatch) -> None:
        run = self.runs.setdefault(batch.job_id, RunRecord())
        process = run.processes.setdefault((batch.attempt, batch.task, batch.rank, batch.process),
                                           ProcessRecord(node=batch.node))
        points = fresh(run.taken, batch)
        process.points += len(points)
        process.finished_at = batch.finished_at or process.finished_at
        for point in points:
            stats = run.series.get((point.name, batch.task, batch.rank))
            if stats is None:
                run.series[(point.name, batch.task, batch.rank)] = SeriesStats(
                    count=1, last=point.value, least=point.value, greatest=point.value, last_step=point.step,
                    last_at=point.at)
            else:
                stats.add(point)
        run.config.update(batch.config)  # the same values again, when sent again
        run.summary.update(batch.summary)

    def view(self, job_id: str) -> RunView:
        run = self.runs.get(job_id, RunRecord())
        series = [SeriesView(name=name, task=task, rank=rank, count=s.count, last=s.last, least=s.least,
                             greatest=s.greatest, last_step=s.last_step, last_at=s.last_at)
                  for (name, task, rank), s in sorted(run.series.items())]
        processes = [ProcessView(attempt=attempt, task=task, rank=rank, node=p.node, process=label, points=p.points,
                                 finished_at=p.finished_at)
                     for (attempt, task, rank, label), p in sorted(run.processes.items())]
        return RunView(job_id=job_id, series=series, config=dict(run.config), summary=dict(run.summary),
                       processes=processes)


def page_points(batch: MetricBatch, taken: dict[ProcessKey, int], name: str, rank: int | None) -> list[SeriesPoint]:
    """The points of series `name` (of `rank`, or every rank) in a batch read from the stream, once each."""
    if rank is not None and batch.rank != rank:
        return []
    return [SeriesPoint(rank=batch.rank, step=point.step, value=point.value, at=point.at, task=batch.task,
                        attempt=batch.attempt, process=batch.process, seq=point.seq, node=batch.node)
            for point in fresh(taken, batch) if point.name == name]


class RunReader:
    """Reads a job's run from the metrics stream for those who may view the job (J2), an archived one's too."""

    def __init__(self, js: JetStreamContext, jobs: JobLifecycle, lives: Mapping[str, RunLife],
                 past: PastJobs | None = None) -> None:
        self.js = js
        self.jobs = jobs
        self.lives = lives  # each run's life, as the monitor recorded it (`runlife`)
        self.past = past  # jobs archived, read back when asked about

    def routes(self) -> list[Route]:
        return [(GET_RUN, self.run), (GET_SERIES, self.series)]

    async def job(self, job_id: str, identity: Identity) -> tuple[JobRecord, RunLife | None] | CommandError:
        """The job and its run's life, if the caller may view it. A job the caller may not view is answered as one
        that does not exist (J2), so ids cannot be probed; so is an archived job that it may not."""
        try:
            found = await job_to_answer(self.jobs, self.past, job_id, identity)
        except (nats.errors.Error, OSError) as exc:
            return events_unavailable(exc)
        if found is None:
            return CommandError(code="not-found", message=f"no such job: {job_id}",
                                hint="`trainyard list` shows the jobs you can see")
        job, past = found
        return job, past.life if past is not None else self.lives.get(job_id)

    async def batches(self, job: JobRecord, after: int = 0) -> AsyncIterator[tuple[int, MetricBatch]]:
        """The job's batches from stream position `after` on, with their positions, as the agents of its nodes
        published them: fetched a few at a time by a pull consumer on the job's subjects, so that a page costs
        the batches it holds, not one round trip each."""
        job_id, ran_on = job.job_id, job.nodes_used
        subject = subjects.metrics_of_job(job_id)
        async with contextlib.aclosing(read_pulled(self.js, subjects.METRICS_STREAM, subject, after=after)) as msgs:
            async for msg in msgs:
                try:
                    batch = decode(msg.data or b"", MetricBatch)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue  # not what an agent publishes: nothing of it is shown
                # Taken from the agent of a node the job ran on, which NATS let publish only as itself.
                if batch.job_id == job_id and batch.node in ran_on and msg.subject == subjects.job_metrics(
                        job_id, batch.node):
                    yield stream_sequence(msg), batch

    async def run(self, request: GetRun, identity: Identity) -> RunView | CommandError:
        found = await self.job(request.job_id, identity)
        if isinstance(found, CommandError):
            return found
        job, life = found
        index = RunIndex()
        try:
            async for _, batch in self.batches(job):
                index.fold(batch)
        except (nats.errors.Error, OSError) as exc:
            return unavailable(exc)
        return with_life(index.view(request.job_id), life)

    async def series(self, request: GetSeries, identity: Identity) -> SeriesPage | CommandError:
        asked = await self.job(request.job_id, identity)
        if isinstance(asked, CommandError):
            return asked
        job, _ = asked
        points: list[SeriesPoint] = []
        taken: dict[ProcessKey, int] = {}
        position, more = request.after, False
        try:
            async for at, batch in self.batches(job, request.after):
                found = page_points(batch, taken, request.name, request.rank)
                if points and len(points) + len(found) > request.limit:  # the next page begins with this batch
                    more = True
                    break
                points += found
                position = at
        except (nats.errors.Error, OSError) as exc:
            return unavailable(exc)
        return SeriesPage(points=points, next_after=position, more=more)


def with_life(view: RunView, life: RunLife | None) -> RunView:
    """The view with the run's life: waiting for the job's first process, running, or finished."""
    if life is None:
        return view
    finished = life.finished
    return msgspec.structs.replace(
        view, state="finished" if finished else "running", began_at=life.began_at, attempts=list(life.attempts),
        finished_at=finished.finished_at if finished else None, finished_by=finished.by if finished else None,
        ended=life.rank_ends())


def unavailable(exc: Exception) -> CommandError:
    return CommandError(code="unavailable", message=f"the metrics stream did not answer ({type(exc).__name__})",
                        hint="JetStream may be restarting; try again")
