"""A job's run as TensorBoard event files (R2, O5): what `trainyard tensorboard` serves and the console's
"Create TensorBoard" download holds.

Each TensorBoard run is a directory, `rank-<r>` for a regular job and `task-<t>/rank-<r>` for a batch job,
written by one tensorboardX writer in ascending step order, a scalar per series name. TensorBoard reads an
event file in the order it was written: a step seen again after a later one is purged (with everything
after it) or shown out of order. A run's points come in the order they were logged, across attempts, so
they are put in step order first, and of a step logged again (by a resumed or restarted attempt, or
twice) the latest value is the one written. A point logged without a step takes its position in its
series' logged order as its step.

Reading the run (get-run, then get-series page by page) is the caller's: the client and the gateway each ask
in their own way. tensorboardX is imported when writing, never with this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.contracts.operations.runs import RunView, SeriesPoint

# TensorBoard's event files begin with this (their writer adds the time and the host).
EVENT_FILE_PREFIX = "events.out.tfevents."


class NoMetrics(Exception):
    """The job logged nothing to write (or, with rank 0 alone, only ranks > 0 did)."""

    def __init__(self, job_id: str, *, other_ranks: bool) -> None:
        self.job_id = job_id
        self.other_ranks = other_ranks
        super().__init__(f"{job_id}: only ranks > 0 logged metrics" if other_ranks
                         else f"{job_id} has logged no metrics")


@dataclass(frozen=True)
class Scalar:
    step: int
    value: float
    wall_time: float  # seconds since the epoch: when the point was logged


@dataclass(frozen=True)
class WrittenSeries:
    tag: str  # the series' name
    steps: int  # scalars written, one per step
    first_step: int
    last_step: int
    replaced: int  # points whose step was logged again later (the later value was written)


@dataclass(frozen=True)
class WrittenRun:
    name: str  # TensorBoard's name of the run: its directory under the folder
    path: Path
    series: list[WrittenSeries]


def run_name(task: int, rank: int, *, batch: bool) -> str:
    """The TensorBoard run (directory) of one rank of one task."""
    return f"task-{task}/rank-{rank}" if batch else f"rank-{rank}"


def names_to_read(view: RunView, *, all_ranks: bool) -> list[str]:
    """The series names to read: those rank 0 logged, or with `all_ranks` those any rank logged."""
    return sorted({series.name for series in view.series if all_ranks or series.rank == 0})


def points_to_read(view: RunView, *, all_ranks: bool) -> int:
    """How many points reading the run would take, as the run counts them: rank 0's, or every rank's."""
    return sum(series.count for series in view.series if all_ranks or series.rank == 0)


@dataclass(frozen=True)
class _Kept:
    attempt: int
    scalar: Scalar


class SeriesScalars:
    """One series of one rank, one value per step: of a step logged again, the latest attempt's latest."""

    def __init__(self) -> None:
        self.logged = 0
        self._kept: dict[int, _Kept] = {}

    def add(self, point: SeriesPoint) -> None:
        step = point.step if point.step is not None else self.logged
        self.logged += 1
        held = self._kept.get(step)
        # Points come in logged order: a point of the same or a later attempt replaces the one held.
        if held is None or point.attempt >= held.attempt:
            self._kept[step] = _Kept(point.attempt, Scalar(step, point.value, point.at.timestamp()))

    @property
    def replaced(self) -> int:
        return self.logged - len(self._kept)

    def scalars(self) -> list[Scalar]:
        return [self._kept[step].scalar for step in sorted(self._kept)]


class RunCollector:
    """A job's points, by TensorBoard run and series name."""

    def __init__(self, *, batch: bool) -> None:
        self.batch = batch
        self.runs: dict[str, dict[str, SeriesScalars]] = {}

    def add(self, name: str, point: SeriesPoint) -> None:
        series = self.runs.setdefault(run_name(point.task, point.rank, batch=self.batch), {})
        series.setdefault(name, SeriesScalars()).add(point)

    def add_all(self, name: str, points: Iterable[SeriesPoint]) -> None:
        for point in points:
            self.add(name, point)


def write_collected(folder: Path, collector: RunCollector) -> list[WrittenRun]:
    """Write every run the collector holds under `folder`, runs in name order."""
    return [write_scalars(folder, name, {tag: series.scalars() for tag, series in sorted(runs.items())},
                          replaced={tag: series.replaced for tag, series in runs.items()})
            for name, runs in sorted(collector.runs.items())]


def write_scalars(folder: Path, name: str, series: Mapping[str, Sequence[Scalar]], *,
                  replaced: Mapping[str, int] | None = None) -> WrittenRun:
    """Write run `name` (its directory under `folder`) with one writer, every series' scalars merged in
    ascending step order. Event files an earlier writing left there are removed first, so that writing a
    run again replaces it rather than adding to it."""
    from tensorboardX import SummaryWriter

    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob(f"{EVENT_FILE_PREFIX}*"):
        stale.unlink()
    ordered = sorted(((scalar.step, tag, scalar) for tag, scalars in series.items() for scalar in scalars),
                     key=lambda item: (item[0], item[1]))
    writer = SummaryWriter(logdir=str(path))
    try:
        for step, tag, scalar in ordered:
            writer.add_scalar(tag, scalar.value, global_step=step, walltime=scalar.wall_time)
    finally:
        writer.close()
    written = [WrittenSeries(tag=tag, steps=len(scalars), first_step=scalars[0].step, last_step=scalars[-1].step,
                             replaced=(replaced or {}).get(tag, 0))
               for tag, scalars in series.items() if scalars]
    return WrittenRun(name=name, path=path, series=written)


def write_points(folder: Path, series: Mapping[str, Iterable[SeriesPoint]], *, batch: bool) -> list[WrittenRun]:
    """Write points already read (series name to its points, in logged order) as TensorBoard runs."""
    collector = RunCollector(batch=batch)
    for name, points in series.items():
        collector.add_all(name, points)
    return write_collected(folder, collector)
