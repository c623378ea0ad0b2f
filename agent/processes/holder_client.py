"""A node's command as the agent sees it through its holder (agent/processes/holder.py): started, or adopted
from an agent that ran before, and waited for until its exit, whichever agent started it. Its output, which
the holder writes to the rank's `output.log`, is shipped from there (agent/output/tail.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from agent.processes.holder import EXIT_NAME, exit_fields, exit_record, start_ticks, write_atomically

HOLDER = Path(__file__).with_name("holder.py")
POLL_SECONDS = 0.1
# A holder of this agent's says when a command ended (or its end tells, by its pipe's): it is looked
# at only this often besides.
TOLD_POLL_SECONDS = 2.0
HOLDER_START_SECONDS = 30.0  # a loaded host may be slow to start a Python
HOLDER_LOOK_SECONDS = 1.0  # how often whether the holder still runs is asked, at most (`HoldServer._holder_runs`)


def _request_line(fields: dict[str, object]) -> bytes:
    """A request to the holder, one line of JSON: by msgspec's encoder (a start's argv and environment cost json's
    six times as much), or json's where msgspec refuses (an environment value of undecodable bytes, kept by Python
    as lone surrogates, which json escapes and gives back as they were)."""
    try:
        return msgspec.json.encode(fields) + b"\n"
    except (UnicodeError, msgspec.EncodeError):
        return json.dumps(fields).encode() + b"\n"


class HolderFailed(OSError):
    """The holder could not be started, or could not start the command nor record why."""


class HoldServer:
    """The agent's holder (`holder.py --serve`): started on first use, and again when it ended.

    Its answers are read as they come, without blocking the loop: `started <pid>` for each request, in
    order, and `ended <pid>` once a command ended (its exit recorded), which wakes who waits for that
    exit at once rather than at its next look. A plain process with pipes rather than an asyncio
    subprocess: asyncio kills the process of a subprocess transport that is closed, and the holder must
    outlive its agent for as long as its commands run."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self.since = 0  # the holder's start ticks: with its pid, what tells it from a later process
        self._read = b""
        self._answers: collections.deque[asyncio.Future[int]] = collections.deque()
        self._ended: dict[int, asyncio.Event] = {}  # command pid -> set once it ended
        # (command pid, its folder) -> its exit, as the holder told it
        self._exits: dict[tuple[int, str], tuple[int, datetime]] = {}
        self._turn = asyncio.Lock()  # one request on its way at a time, so answers come in order
        self._writing = asyncio.Lock()  # one line at a time into the holder's input
        self._polled_at = -HOLDER_LOOK_SECONDS  # when it was last asked whether the holder still runs

    async def hold(self, folder: Path, argv: list[str], env: dict[str, str], cwd: Path, *,
                   sandbox: bool = False, view: str | None = None) -> int:
        """Have the holder start a command for the rank `folder`: its pid, 0 when it could not start
        (its output says why, its exit is recorded). `sandbox`: the command is bwrap's, started from the
        holder's sandbox mounts (holder.SandboxMounts); `view`: the host view it binds (sandbox.HostView.request)."""
        # Through the pipe, never on disk: the job's secrets are in its environment.
        fields: dict[str, object] = {"folder": str(folder), "argv": argv, "env": env, "cwd": str(cwd)}
        if sandbox:
            fields["sandbox"] = True
            if view is not None:
                fields["view"] = view
        request = _request_line(fields)
        failure = "the holder did not answer"
        async with self._turn:
            for _ in range(2):  # a holder that ended meanwhile is started again once
                process = self._running()
                answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
                self._answers.append(answer)
                try:
                    async with asyncio.timeout(HOLDER_START_SECONDS):
                        assert process.stdin is not None
                        async with self._writing:
                            await _write(process.stdin.fileno(), request)
                        return await answer
                except HolderFailed:  # it answered: nothing could be started nor recorded for this folder
                    raise
                except (OSError, EOFError, ValueError, TimeoutError) as exc:  # gone, or answering nonsense
                    failure = f"the holder did not answer: {exc!r}"
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    self._forget()
            raise HolderFailed(failure)

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else 0

    def ended(self, pid: int) -> asyncio.Event:
        """Set once the command `pid`, started by this holder, ended."""
        return self._ended.setdefault(pid, asyncio.Event())

    def exit_of(self, pid: int, folder: Path) -> tuple[int, datetime] | None:
        """The exit of the command `pid` of the rank `folder` as the holder told it, if it did."""
        return self._exits.get((pid, str(folder)))

    def forget(self, pid: int, folder: Path) -> None:
        self._ended.pop(pid, None)
        self._exits.pop((pid, str(folder)), None)

    async def reported(self, pid: int) -> None:
        """The exit of the command `pid` is reported and its record removed: the holder need not write it down.
        A holder gone meanwhile, or started again since, has nothing of it to forget."""
        process = self._process
        if process is None or not self._holder_runs(process) or process.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            async with self._writing:
                await _write(process.stdin.fileno(), f"reported {pid}\n".encode())

    def _holder_runs(self, process: subprocess.Popen[bytes]) -> bool:
        """Whether the holder still runs, as last looked (HOLDER_LOOK_SECONDS ago at most): each look is a wait4 call,
        which on a host starting and ending sandboxes by the hundred a second waits on the kernel's process list. One
        that ended since is known anyway: the end of its output is read at once (`_readable`), and a write into its
        input fails, which starts another (`hold`)."""
        now = time.monotonic()
        if process.returncode is None and now - self._polled_at >= HOLDER_LOOK_SECONDS:
            self._polled_at = now
            process.poll()
        return process.returncode is None

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None or not self._holder_runs(self._process):
            self._forget()
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(HOLDER), "--serve", "--tell-exits"], env={}, cwd="/",
                start_new_session=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.since = start_ticks(self._process.pid) or 0
            assert self._process.stdin is not None and self._process.stdout is not None
            os.set_blocking(self._process.stdin.fileno(), False)
            os.set_blocking(self._process.stdout.fileno(), False)
            asyncio.get_running_loop().add_reader(self._process.stdout.fileno(), self._readable)
        return self._process

    def _readable(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        try:
            data = os.read(self._process.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the holder ended: who waits for an answer or an exit is told
            for ended in self._ended.values():
                ended.set()
            self._forget(EOFError("the holder ended"))
            return
        self._read += data
        while b"\n" in self._read:
            line, _, self._read = self._read.partition(b"\n")
            kind, *values = line.decode(errors="replace").split(" ", 2)
            if kind == "ended" and values and values[0].isdigit():
                if len(values) == 2 and (told := _told_exit(values[1])) is not None:
                    self._exits[(int(values[0]), told[0])] = told[1]
                self.ended(int(values[0])).set()
            elif kind in ("started", "failed") and self._answers:
                answer = self._answers.popleft()
                if answer.done():
                    continue
                if kind == "failed":
                    answer.set_exception(HolderFailed("the holder could not start the command nor record why"))
                elif len(values) == 1 and values[0].isdigit():
                    self._ended.pop(int(values[0]), None)  # an earlier command's, whose pid this one got
                    answer.set_result(int(values[0]))
                else:
                    answer.set_exception(ValueError(f"not an answer: {line!r}"))

    def _forget(self, error: BaseException | None = None) -> None:
        if self._process is not None:
            assert self._process.stdout is not None
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._process.stdout.fileno())
            for pipe in (self._process.stdin, self._process.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()  # type: ignore[union-attr]
        while self._answers:
            answer = self._answers.popleft()
            if not answer.done():
                answer.set_exception(error or EOFError("the holder was closed"))
        self._process, self._read = None, b""
        # The exits told and not reported yet stay known (`exit_of`): the holder wrote them down as its input
        # ended, unless it ended first.

    def close(self) -> None:
        """No more commands: the holder ends once those it started have ended (it is not killed)."""
        self._forget()


def _told_exit(told: str) -> tuple[str, tuple[int, datetime]] | None:
    """The folder and exit of `ended <pid> <told>` (agent/processes/holder.py `told_exit`); None when it is not one."""
    try:
        found = json.loads(told)
        return str(found["folder"]), _code_and_time(found)
    except (ValueError, KeyError, TypeError):
        return None


def _exit_of(record: str) -> tuple[int, datetime] | None:
    """An exit record's code and time (agent/processes/holder.py `exit_record`); None when it is not one."""
    try:
        return _code_and_time(json.loads(record))
    except (ValueError, KeyError, TypeError):
        return None


def _code_and_time(found: dict[str, Any]) -> tuple[int, datetime]:
    return int(found["exit_code"]), datetime.fromisoformat(found["exited_at"])


async def _write(fd: int, data: bytes) -> None:
    """All of `data` to the non-blocking pipe `fd`, waiting while it is full rather than blocking the loop."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _settle, writable)
            try:
                await writable
            finally:
                loop.remove_writer(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HoldServer] = weakref.WeakKeyDictionary()


def hold_server() -> HoldServer:
    """The holder of the running event loop (an agent's one loop)."""
    loop = asyncio.get_running_loop()
    if (server := _servers.get(loop)) is None:
        server = _servers[loop] = HoldServer()
    return server


class HeldProcess:
    """The command of one rank, run by its holder; `pid` is the command's process group. `holder_pid` and
    `holder_since`: the holder's pid and start ticks, which tell it from a later process given its pid (0:
    unknown, for a holder recorded by an older agent, told by its command line)."""

    def __init__(self, folder: Path, pid: int | None = None, holder_pid: int | None = None,
                 holder_since: int = 0) -> None:
        self.folder = folder
        self.pid = pid or 0
        self.holder_pid = holder_pid or 0
        self.holder_since = holder_since
        self._server: HoldServer | None = None  # the holder that started it, when this agent's
        self._exit: tuple[int, datetime] | None = None  # once known
        self.started_at: datetime | None = None  # when this agent had it started (None: adopted)

    @classmethod
    async def start(cls, folder: Path, argv: list[str], env: dict[str, str], cwd: Path,
                    server: HoldServer | None = None, *, sandbox: bool = False,
                    view: str | None = None) -> HeldProcess:
        """Have the holder start the command: it runs (`pid` set), or could not start (`pid` 0, its exit
        recorded). `sandbox`: the command is a bwrap sandbox's; `view`: the host view it binds."""
        server = server or hold_server()
        pid = await server.hold(folder, argv, env, cwd, sandbox=sandbox, view=view)
        held = cls(folder, pid=pid, holder_pid=server.pid, holder_since=server.since)
        held._server = server
        held.started_at = datetime.now(UTC)
        return held

    @property
    def started(self) -> bool:
        return self.pid > 0

    @property
    def running(self) -> bool:
        return self.started and self.exit() is None

    def exit(self) -> tuple[int, datetime] | None:
        """The command's exit code and time, once its holder told or recorded them."""
        if self._exit is None and self._server is not None and self.pid > 0:
            self._exit = self._server.exit_of(self.pid, self.folder)
        if self._exit is None:
            with contextlib.suppress(OSError):
                self._exit = _exit_of((self.folder / EXIT_NAME).read_text())
        return self._exit

    async def reported(self) -> None:
        """Its exit is reported and its record gone: the holder that told it need not write it down."""
        if self._server is not None and self.pid > 0:
            await self._server.reported(self.pid)

    async def wait(self) -> int:
        code, _ = await self.wait_exit()
        return code

    async def wait_exit(self) -> tuple[int, datetime]:
        """The exit the holder records; a holder gone without recording one (killed), or that could not
        record it, ends the command and counts as a kill (137). The holder that started the command says at
        once when it ended, or ends its pipe when it ends itself; one of an agent before is looked at every
        POLL_SECONDS."""
        ended = self._server.ended(self.pid) if self._server is not None and self.pid > 0 else None
        try:
            if ended is not None and not ended.is_set():  # its holder tells: no look at files or processes first
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), TOLD_POLL_SECONDS)
            while (found := self.exit()) is None:
                if (ended is not None and ended.is_set()) or not self._holder_alive():
                    await asyncio.sleep(POLL_SECONDS)  # it may have written the exit as it ended
                    if (found := self.exit()) is not None:
                        return found
                    if not self.folder.exists():  # the node was reported and its folder removed meanwhile
                        return 137, datetime.now(UTC)
                    self.signal(signal.SIGKILL)  # unwatched, it would run on without anyone to report it
                    write_atomically(self.folder / EXIT_NAME, exit_record(exit_fields(137, started=self.started)))
                    continue
                if ended is None:
                    await asyncio.sleep(POLL_SECONDS)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), TOLD_POLL_SECONDS)
            return found
        finally:
            if self._server is not None:
                self._server.forget(self.pid, self.folder)

    def _holder_alive(self) -> bool:
        """Whether the holder still runs: that pid, started then (not a pid the system gave to something
        else since, after a reboot)."""
        if self.holder_since:
            return start_ticks(self.holder_pid) == self.holder_since
        # Started by an older agent as a process of its own, with this folder on its command line.
        return _alive(self.holder_pid) and str(self.folder).encode() in _command_line(self.holder_pid)

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to every member of the command's group (none left: nothing happens)."""
        if self.pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
