"""The socket a job's processes log their metrics to (SPEC R1), one per rank, relayed to JetStream.

Each rank gets a Unix socket (TRAINYARD_RUN_SOCKET in its environment; under bubblewrap it is the only
thing of the agent's the job sees, at /run/trainyard/run.sock). Lines come from `trainyard.run` in any
process of the rank (libs/contracts/runs.py): each is checked, size-bounded, and taken once per process
in its numbering (a line sent again after a reconnection is dropped here when it was taken already).
What arrives is batched per process, at most `MAX_POINTS_PER_BATCH` points or `FLUSH_SECONDS` old, and
published as a `MetricBatch` named by the job, attempt, task, rank and process; once JetStream has it, the
process is told (`AckLine`) and forgets those lines. A batch's message id is made of its first and last
line numbers, so a batch published again is dropped by JetStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

from libs.contracts.codec import decode_any, encode
from libs.contracts.runs import (
    MAX_POINTS_PER_BATCH,
    MAX_RUN_LINE_BYTES,
    AckLine,
    LoggedLine,
    MetricBatch,
    MetricPoint,
    RunLine,
    Scalar,
    SetLine,
)
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
FLUSH_SECONDS = 0.5
SANDBOX_SOCKET = "/run/trainyard/run.sock"  # where a bubblewrapped job finds it
SYSTEM_PROCESS = "system"  # the label of the agent's own samples of the rank (a job's process is pid-<n>)
Publish = Callable[[MetricBatch, str], Awaitable[None]]  # a batch and its message id


def remove_run_folder(rank_folder: Path) -> None:
    """The rank's socket folder, once its environment is gone."""
    path = socket_path(rank_folder)
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
        path.parent.rmdir()


def socket_path(rank_folder: Path) -> Path:
    """Where a rank's socket is made: short, as a Unix socket's path must be (108 bytes at most), in a folder
    of the rank's own, which a bubblewrapped job sees as /run/trainyard (so that the socket an agent makes
    again after a restart is the one the job finds)."""
    digest = hashlib.sha256(str(rank_folder).encode()).hexdigest()[:20]
    return Path(f"{runs_folder()}/{digest}/run.sock")


@functools.cache
def runs_folder() -> str:
    """Where every rank's socket folder is made: hidden from jobs (one job's processes must not log into
    another's run), each rank's own folder bound where its job finds it."""
    return os.path.join(tempfile.gettempdir(), "trainyard-runs")


@dataclass
class _Writer:
    """What one process logged and the relay has not published yet."""

    taken: int = 0  # its highest line number taken
    lines: list[RunLine] = field(default_factory=list)
    connections: set[asyncio.StreamWriter] = field(default_factory=set)


class RunRelay:
    def __init__(self, *, job_id: str, attempt: int, task: int, rank: int, node: str, path: Path,
                 publish: Publish) -> None:
        self.job_id, self.attempt, self.task, self.rank, self.node = job_id, attempt, task, rank, node
        self.path = path
        self.publish = publish
        self.refused = 0  # lines that were not what `trainyard.run` sends
        self._writers: dict[str, _Writer] = {}
        self._waiting = 0  # lines taken since the last flush began
        self._server: asyncio.Server | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket an agent before left
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path),
                                                       limit=MAX_RUN_LINE_BYTES + 1)
        folder = self.path.parent.stat()
        # Given to the job's user (agent/isolation/workspace.py): so is a socket made again.
        if folder.st_uid != os.geteuid():
            os.chown(self.path, folder.st_uid, folder.st_gid)

    def _taken(self) -> None:
        """A line was taken: flushed within FLUSH_SECONDS from now on (a rank that logs nothing costs no timer)."""
        if self._flusher is None and self._server is not None and self._server.is_serving():
            self._flusher = asyncio.create_task(self._flush_periodically())

    async def close(self) -> None:
        """Publish what is left, then stop listening."""
        if self._server is not None:
            self._server.close()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self.flush()
        self._hang_up()
        with contextlib.suppress(OSError):
            self.path.unlink()  # its folder stays while the rank's environment is kept (debug sessions bind it)

    def abandon(self) -> None:
        """Stop listening and publishing: the agent is going away. What was not acknowledged yet its processes
        send again to the next agent's socket."""
        if self._server is not None:
            self._server.close()
        if self._flusher is not None:
            self._flusher.cancel()
        self._hang_up()

    def _hang_up(self) -> None:
        for writer in self._writers.values():
            for connection in writer.connections:
                connection.close()

    async def _serve(self, reader: asyncio.StreamReader, connection: asyncio.StreamWriter) -> None:
        processes: set[str] = set()
        try:
            while True:
                try:
                    raw = await reader.readuntil(b"\n")
                except asyncio.LimitOverrunError:
                    self._refuse("a line longer than the limit")
                    break  # the stream cannot be resynchronised: the process reconnects
                except asyncio.IncompleteReadError:
                    break
                try:
                    line: RunLine = decode_any(raw, RunLine)  # a decoder made once: the relay's hottest line
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self._refuse(str(exc))
                    continue
                writer = self._writers.setdefault(line.process, _Writer())
                writer.connections.add(connection)
                processes.add(line.process)
                if line.seq > writer.taken:  # a line sent again is taken once
                    writer.taken = line.seq
                    writer.lines.append(line)
                    self._waiting += 1
                    self._taken()
                    if self._waiting >= MAX_POINTS_PER_BATCH:
                        # Published before more is read: while JetStream is away the job's own buffer fills,
                        # not the agent's memory.
                        await self.flush()
        finally:
            for process in processes:
                self._writers[process].connections.discard(connection)
            connection.close()

    def system(self, values: dict[str, float], at: datetime) -> None:
        """R1: the rank's system metrics (its CPU, memory, accelerators, as the agent samples them), as the
        run's `system/…` series of this rank. Numbered by their time in milliseconds, so that the samples of
        an agent started again follow those of the one before instead of being taken for them."""
        writer = self._writers.setdefault(SYSTEM_PROCESS, _Writer())
        seq = int(at.timestamp() * 1000)
        if seq > writer.taken:
            writer.taken = seq
            writer.lines.append(LoggedLine(process=SYSTEM_PROCESS, seq=seq, at=at,
                                           values={f"system/{name}": value for name, value in values.items()}))
            self._taken()

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning("run.line_refused", job_id=self.job_id, attempt=self.attempt, rank=self.rank,
                        node=self.node, refused=self.refused, reason=why[:200])

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> None:
        """Publish each process's lines taken so far, then acknowledge them to it."""
        async with self._lock:
            self._waiting = 0  # what arrives while this publishes counts towards the next flush
            # A process that first logs while a batch is published joins the writers then: taken next flush.
            for process, writer in list(self._writers.items()):
                while writer.lines:
                    taken = _fitting(writer.lines)
                    lines, writer.lines = writer.lines[:taken], writer.lines[taken:]
                    batch = self._batch(process, lines)
                    await self.publish(batch, f"{self.job_id}.{self.attempt}.{self.task}.{self.rank}.{process}."
                                              f"{lines[0].seq}-{lines[-1].seq}")
                    ack = encode(AckLine(process=process, seq=lines[-1].seq)) + b"\n"
                    for connection in list(writer.connections):
                        with contextlib.suppress(ConnectionError, RuntimeError):
                            connection.write(ack)

    def _batch(self, process: str, lines: list[RunLine]) -> MetricBatch:
        points: list[MetricPoint] = []
        config: dict[str, Scalar] = {}
        summary: dict[str, Scalar] = {}
        finished_at: datetime | None = None
        for line in lines:
            if isinstance(line, LoggedLine):
                points += [MetricPoint(seq=line.seq, name=name, value=value, at=line.at, step=line.step)
                           for name, value in line.values.items()]
            elif isinstance(line, SetLine):
                (config if line.what == "config" else summary).update(line.values)
            else:
                finished_at = line.at
        return MetricBatch(job_id=self.job_id, attempt=self.attempt, task=self.task, rank=self.rank, node=self.node,
                           process=process, points=points, config=config, summary=summary, finished_at=finished_at)


def _fitting(lines: list[RunLine]) -> int:
    """How many of `lines`, from the first, make one batch of at most MAX_POINTS_PER_BATCH points."""
    points = 0
    for count, line in enumerate(lines):
        size = len(line.values) if isinstance(line, LoggedLine) else 0
        if count and points + size > MAX_POINTS_PER_BATCH:
            return count
        points += size
    return len(lines)
