"""TensorBoard over a job's run (R2, O5): event files written from the run's series, and the real
TensorBoard serving them.

Each TensorBoard run is a directory, `rank-<r>` for a regular job and `task-<t>/rank-<r>` for a batch job,
written by one tensorboardX writer in ascending step order, a scalar per series name. TensorBoard reads an
event file in the order it was written: a step seen again after a later one is purged (with everything
after it) or shown out of order. A run's points come in the order they were logged, across attempts, so
they are put in step order first, and of a step logged again (by a resumed or restarted attempt, or
twice) the latest value is the one written. A point logged without a step takes its position in its
series' logged order as its step.

tensorboardX and TensorBoard are imported when used, never with this module.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from libs.contracts.operations.runs import RunView, SeriesPoint

# TensorBoard's event files begin with this (their writer adds the time and the host).
EVENT_FILE_PREFIX = "events.out.tfevents."
# A slow machine takes several seconds to import TensorBoard and load the first runs.
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0
# How often the progress callback hears of a long series while it is read.
PROGRESS_EVERY_POINTS = 1000
# Where to reach a server listening on every address from this machine.
WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class NoMetrics(Exception):
    """The job logged nothing to write (or, with rank 0 alone, only ranks > 0 did)."""

    def __init__(self, job_id: str, *, other_ranks: bool) -> None:
        self.job_id = job_id
        self.other_ranks = other_ranks
        super().__init__(f"{job_id}: only ranks > 0 logged metrics" if other_ranks
                         else f"{job_id} has logged no metrics")


class TensorBoardFailed(Exception):
    """TensorBoard did not start, or ended by itself; the message carries what it wrote on stderr."""


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


@dataclass(frozen=True)
class ReadProgress:
    """How far reading a run has got: series read of all to read, points read so far, the series being read."""

    series_done: int
    series_total: int
    points: int
    name: str


ProgressCallback = Callable[[ReadProgress], None]


def run_name(task: int, rank: int, *, batch: bool) -> str:
    """The TensorBoard run (directory) of one rank of one task."""
    return f"task-{task}/rank-{rank}" if batch else f"rank-{rank}"


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


def names_to_read(view: RunView, *, all_ranks: bool) -> list[str]:
    """The series names to read: those rank 0 logged, or with `all_ranks` those any rank logged."""
    return sorted({series.name for series in view.series if all_ranks or series.rank == 0})


async def write_run(client: TrainyardClient, job_id: str, folder: Path, *, all_ranks: bool = False,
                    progress: ProgressCallback | None = None) -> list[WrittenRun]:
    """Read the job's run and write it under `folder` as TensorBoard runs: rank 0 of each task, or every
    rank with `all_ranks`. Raises NoMetrics when there is nothing to write, and the client's
    TrainyardError when the job cannot be read (not found, or no read access)."""
    view = await client.run(job_id)
    names = names_to_read(view, all_ranks=all_ranks)
    if not names:
        raise NoMetrics(job_id, other_ranks=bool(view.series))
    batch = (await client.get_job(job_id)).spec.type == "batch"
    collector = RunCollector(batch=batch)
    points = 0
    for done, name in enumerate(names):
        if progress is not None:
            progress(ReadProgress(done, len(names), points, name))
        async for point in client.series(job_id, name, rank=None if all_ranks else 0):
            collector.add(name, point)
            points += 1
            if progress is not None and points % PROGRESS_EVERY_POINTS == 0:
                progress(ReadProgress(done, len(names), points, name))
    if progress is not None:
        progress(ReadProgress(len(names), len(names), points, ""))
    return write_collected(folder, collector)


class TensorBoard:
    """The real TensorBoard serving `folder`, as a process of its own.

    `start` returns once its HTTP server answers (port 0: a free port, which `url` then names); `stop`
    asks it to end and kills it when it does not in time. As a context manager it is started and stopped.
    """

    def __init__(self, folder: Path, host: str = "127.0.0.1", port: int = 6006, *, title: str | None = None,
                 start_timeout: float = START_TIMEOUT_SECONDS) -> None:
        self.folder = folder
        self.host = host
        self.port = port
        self.title = title
        self.start_timeout = start_timeout
        self.url = ""
        self.pid: int | None = None  # its process, once started (kept after it ends)
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.folder), "--host", self.host,
                "--port", str(self.port)]
        return [*argv, "--window_title", self.title] if self.title else argv

    def start(self) -> str:
        """Start TensorBoard and wait until it answers; its URL. Raises TensorBoardFailed (and leaves
        nothing running) when it exits or does not answer in time."""
        # Its output goes to a file, not a pipe nobody reads while it runs (a full pipe would stop it).
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by `stop`)
        # A session of its own: Ctrl-C in the terminal reaches this process, which then stops TensorBoard.
        self._process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=self._stderr, start_new_session=True)
        self.pid = self._process.pid
        try:
            self.url = self._wait_until_answering()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_until_answering(self) -> str:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            code = self.returncode
            if code is not None:
                raise TensorBoardFailed(f"TensorBoard exited with code {code}: {self.errors()}")
            url = self._announced_url()
            if url and answers(url):
                return url
            time.sleep(0.2)
        raise TensorBoardFailed(f"TensorBoard did not answer within {self.start_timeout:.0f} s: {self.errors()}")

    def _announced_url(self) -> str | None:
        """The address TensorBoard says it serves at, once it has bound its port."""
        match = re.search(r" at (https?://\S+)", self.stderr_text())
        if match:
            return match.group(1)
        return None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def errors(self) -> str:
        """What TensorBoard reported as errors, else the end of what it wrote."""
        lines = [line.strip() for line in self.stderr_text().splitlines() if line.strip()]
        reported = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
        return "; ".join(reported or lines[-5:]) or "it wrote nothing"

    def wait(self) -> int:
        """Block until TensorBoard ends; its exit code."""
        if self._process is None:
            raise RuntimeError("TensorBoard was not started")
        return self._process.wait()

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        """End TensorBoard: asked first, killed when it has not ended within `timeout` seconds."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> TensorBoard:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def answers(url: str) -> bool:
    """Whether TensorBoard at `url` answers its list of runs."""
    import urllib.error
    import urllib.request

    parts = urlsplit(url)
    # Listening on every address, TensorBoard announces that address: ask it on this machine.
    host = WILDCARD_HOSTS.get(parts.hostname or "", parts.hostname or "127.0.0.1")
    netloc = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    address = f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}/data/runs"
    with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(address, timeout=2) as reply:
        status: int = reply.status
        return status == 200
    return False


def serve(folder: Path, host: str = "127.0.0.1", port: int = 6006, *, title: str | None = None) -> TensorBoard:
    """TensorBoard serving `folder`, started and answering; stop it with `stop()`."""
    server = TensorBoard(folder, host, port, title=title)
    server.start()
    return server
