"""One node's process group: started in its own session, its output read line by line, killed whole; and
the records of the ranks this node's agents started, by which a later agent adopts them or ends them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec

from agent.output.tail import append_note
from agent.processes.holder_client import HeldProcess
from agent.processes.signals import Attempt, attempt_processes, send
from agent.ranks.kept import RecordedEnvironment, node_files

LineSink = Callable[[str], Awaitable[None]]
# A longer output line is passed on in pieces of this size, so that no line breaks the reader and
# a log chunk of them stays well within one NATS message.
MAX_LINE_BYTES = 16 * 1024
READ_BYTES = 64 * 1024


async def output_lines(stream: asyncio.StreamReader, max_bytes: int = MAX_LINE_BYTES) -> AsyncIterator[bytes]:
    """The lines of `stream` without their newline; a line longer than `max_bytes` in pieces of it."""
    buffer = b""
    while data := await stream.read(READ_BYTES):
        buffer += data
        start = 0
        while True:
            end = buffer.find(b"\n", start, start + max_bytes + 1)
            if end != -1:
                yield buffer[start:end]
                start = end + 1
            elif len(buffer) - start >= max_bytes:
                yield buffer[start:start + max_bytes]
                start += max_bytes
            else:
                break
        buffer = buffer[start:]
    if buffer:
        yield buffer


class ProcessGroup:
    """A command run as the leader of a new session, so that stop() reaches every child it forks."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )

    async def pump(self, sink: LineSink) -> int:
        """Send every output line to `sink` (and the node's log file); return the exit code."""
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as log_file:
            async for raw in output_lines(self.proc.stdout):
                line = raw.decode("utf-8", errors="replace")
                log_file.write(line + "\n")
                log_file.flush()
                await sink(line)
        code = await self.proc.wait()
        # A process killed by signal N reports -N; shells report 128+N. Use the shell convention.
        return 128 - code if code < 0 else code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        assert self.proc is not None
        return await asyncio.shield(self.proc.wait())

    async def stop(self, grace_seconds: float) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after `grace_seconds`."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(), grace_seconds)
        # The leader may be gone while members of its group ignore SIGTERM: end the whole group.
        self.signal(signal.SIGKILL)

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to every member of the group (none left: nothing happens)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


RECORD_NAME = "process.json"


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """What a later agent needs to adopt a running node (agent/processes/holder_client.py): who it is and where it runs.

    Only the agent's user may read it: the attempt's job token is in it.
    """

    job_id: str
    attempt: int
    task: int = 0
    rank: int
    pid: int  # the command's process group
    holder: int = 0  # its holder's pid
    holder_since: int = 0  # and start ticks (agent/processes/holder.py `start_ticks`); 0 from an older agent
    keep: bool = False
    job_token: str | None = None
    trace: dict[str, str] = {}
    port: int = 0  # the rendezvous port the node listens on (NodeLaunch.port), held again on adoption
    # Its variables and workspace, for the commands run in it later (None from an older agent, which wrote
    # them to session.json, as an agent still does for a launch that keeps its workspace).
    environment: RecordedEnvironment | None = None


def _write_private(path: Path, data: bytes) -> None:
    """Write a file only the agent's user may read (a job token is in it), whole or not at all."""
    partial = path.with_name(f".{path.name}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    partial.replace(path)


def write_record(directory: Path, record: Record) -> None:
    """Remember a running node, so that a later agent can find and adopt it."""
    _write_private(directory / RECORD_NAME, msgspec.json.encode(record))


def remove_record(directory: Path) -> None:
    (directory / RECORD_NAME).unlink(missing_ok=True)


def read_records(root: Path) -> list[tuple[Path, Record]]:
    """Every node recorded under the agent's `root` (its folder and record); unreadable records are skipped."""
    found = []
    for path in node_files(root, RECORD_NAME):
        try:
            found.append((path.parent, msgspec.json.decode(path.read_bytes(), type=Record)))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return found


PENDING_NAME = "start.json"


def write_pending(directory: Path, request: bytes) -> None:
    """Remember a start accepted and not begun yet (its data being staged): a later agent begins it again.
    Only the agent's user may read it, as the record: the attempt's job token is in it."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_private(directory / PENDING_NAME, request)


def remove_pending(directory: Path) -> None:
    (directory / PENDING_NAME).unlink(missing_ok=True)


def read_pending(root: Path) -> list[tuple[Path, bytes]]:
    """Every start accepted under `root` whose process never started (no record beside it)."""
    return [(path.parent, path.read_bytes()) for path in node_files(root, PENDING_NAME)
            if not (path.parent / RECORD_NAME).exists()]


def end_recorded_jobs(root: Path, node: str, reason: str) -> list[Record]:
    """Kill every running node recorded under the agent folder `root` and the rest of its attempt's
    processes on `node`, each rank's output saying `reason`. For shutting a host's platform down
    (`python -m agent --end-jobs`); the next agent there reports the exits its holders recorded."""
    ended = []
    for folder, record in read_records(root):
        held = HeldProcess(folder, record.pid, record.holder, record.holder_since)
        if not held.running:
            continue
        append_note(folder, reason)
        held.signal(signal.SIGKILL)
        # Workers in sessions of their own (torchrun's) are out of the group's reach.
        send(attempt_processes(Attempt(record.job_id, record.attempt, node, record.task), {record.pid}), signal.SIGKILL)
        ended.append(record)
    return ended
