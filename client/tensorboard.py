"""TensorBoard over a job's run (R2, O5): event files written from the run's series, and the real
TensorBoard serving them.

How a run becomes event files (a run per task and rank, in step order, the latest value of a step logged
again) is libs/tensorboard_files.py, which the gateway's console writes with too; its names are re-exported
here. This module reads the run through the client and serves the files.

tensorboardX and TensorBoard are imported when used, never with this module.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

from libs.tensorboard_files import (
    EVENT_FILE_PREFIX,
    NoMetrics,
    RunCollector,
    Scalar,
    SeriesScalars,
    WrittenRun,
    WrittenSeries,
    names_to_read,
    run_name,
    write_collected,
    write_points,
    write_scalars,
)

if TYPE_CHECKING:
    from client.api import TrainyardClient

__all__ = [
    "EVENT_FILE_PREFIX", "NoMetrics", "ProgressCallback", "ReadProgress", "RunCollector", "Scalar", "SeriesScalars",
    "TensorBoard", "TensorBoardFailed", "WrittenRun", "WrittenSeries", "answers", "names_to_read", "run_name",
    "serve", "write_collected", "write_points", "write_run", "write_scalars",
]

# A slow machine takes several seconds to import TensorBoard and load the first runs.
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0
# How often the progress callback hears of a long series while it is read.
PROGRESS_EVERY_POINTS = 1000
# Where to reach a server listening on every address from this machine.
WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class TensorBoardFailed(Exception):
    """TensorBoard did not start, or ended by itself; the message carries what it wrote on stderr."""


@dataclass(frozen=True)
class ReadProgress:
    """How far reading a run has got: series read of all to read, points read so far, the series being read."""

    series_done: int
    series_total: int
    points: int
    name: str


ProgressCallback = Callable[[ReadProgress], None]


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
