"""Debug sessions in a node's environment (SPEC J15): a command, or an interactive shell on a terminal.

A session runs with the job's variables, in its workspace (in the bwrap sandbox when the job had
one), and speaks on its own subjects (see libs.contracts.agent.OpenSession): input bytes and
control messages come in on `in` and `control`, output bytes go out on `out` in order, then one
SessionExited on `exit`. A session is a session of processes of its own; when its first process
ends, whatever it left behind is killed, so nothing holds the output open or outlives the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from agent.processes.signals import SESSION_VARIABLE
from agent.ranks.kept import Environment
from libs.contracts import subjects
from libs.contracts.agent import OpenSession, SessionControl, SessionExited
from libs.contracts.codec import decode, encode
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
CHUNK_BYTES = 64 * 1024
# Output still in flight once the session's processes are gone; a bound, in case a process that
# left the session's process group still holds the output open.
DRAIN_SECONDS = 5.0
EOF_CHARACTER = b"\x04"  # what Ctrl-D types: the end of input for a program reading the terminal
# Makes the pseudo-terminal the controlling terminal of the new session (so that Ctrl-C reaches the
# foreground program), then runs the session's command; isolated, so the job's PYTHON* variables
# cannot break it.
TAKE_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "os.execvp(sys.argv[1], sys.argv[1:])")

Input = bytes | SessionControl


def interactive_shell(root: Path | None = None) -> list[str]:
    """bash where the job's root filesystem (the host's, or its image's) has it, else sh."""
    return ["/bin/bash", "-i"] if ((root or Path("/")) / "bin/bash").exists() else ["/bin/sh", "-i"]


def _set_size(fd: int, columns: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def _size(fd: int) -> tuple[int, int]:
    rows, columns, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    return columns, rows


class Session:
    """One debug session; `start()` runs it, `done` ends once its SessionExited is published."""

    def __init__(self, nc: Client, node: str, request: OpenSession, environment: Environment,
                 directory: Path) -> None:
        self.nc = nc
        self.node = node
        self.request = request
        self.environment = environment
        self.directory = directory  # the node folder whose environment the session runs in
        self.proc: asyncio.subprocess.Process | None = None
        self.done: asyncio.Task[None] | None = None
        self._terminal: int | None = None  # the pseudo-terminal's controlling side (interactive)
        self._inbox: asyncio.Queue[Input] = asyncio.Queue()
        self._subscriptions: list[Subscription] = []
        self._last_control = 0.0
        self._log = log.bind(job_id=request.job_id, attempt=request.attempt, task=request.task, rank=request.rank,
                             node=node, session_id=request.session_id)

    @property
    def session_id(self) -> str:
        return self.request.session_id

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _subject(self, channel: str) -> str:
        return subjects.session(self.node, self.request.owner, self.session_id, channel)

    async def start(self) -> int:
        """Start the session's process; OSError when it cannot be started."""
        self._subscriptions = [await self.nc.subscribe(self._subject("in"), cb=self._on_input),
                               await self.nc.subscribe(self._subject("control"), cb=self._on_control)]
        try:
            self.proc = await (self._start_command() if self.request.command is not None else self._start_shell())
        except OSError:
            await self._unsubscribe()
            raise
        self._last_control = asyncio.get_running_loop().time()
        self.done = asyncio.create_task(self._run())
        self._log.info("agent.session_started", pid=self.proc.pid, interactive=self.request.command is None)
        return self.proc.pid

    def kill(self) -> None:
        """End every process of the session now (its SessionExited still follows)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    # --- starting --------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {**self.environment.env, SESSION_VARIABLE: self.session_id}
        if self.request.command is None:
            env.setdefault("TERM", "xterm-256color")
        return env

    async def _start_command(self) -> asyncio.subprocess.Process:
        assert self.request.command is not None
        workspace = self.environment.workspace
        return await asyncio.create_subprocess_exec(
            *workspace.command(["/bin/sh", "-c", self.request.command]), env=self._env(), cwd=workspace.cwd,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)

    async def _start_shell(self) -> asyncio.subprocess.Process:
        workspace = self.environment.workspace
        shell = interactive_shell(workspace.sandbox.root if workspace.sandbox else None)
        terminal, user_side = os.openpty()
        try:
            _set_size(terminal, self.request.columns, self.request.rows)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-c", TAKE_TERMINAL, *workspace.command(shell),
                env=self._env(), cwd=workspace.cwd, stdin=user_side, stdout=user_side, stderr=user_side,
                start_new_session=True)
        except OSError:
            os.close(terminal)
            raise
        finally:
            # Only the session may hold the terminal's user side: reads then end when it is gone.
            os.close(user_side)
        os.set_blocking(terminal, False)
        self._terminal = terminal
        return proc

    # --- running ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self.proc is not None
        output = asyncio.create_task(self._publish_output())
        helpers = [asyncio.create_task(self._feed_input()), asyncio.create_task(self._watch_idle())]
        code = -1
        try:
            code = await self.proc.wait()
            self.kill()  # what the session's first process left behind
            await asyncio.wait({output}, timeout=DRAIN_SECONDS)
        finally:
            for task in (output, *helpers):
                task.cancel()
            await self._unsubscribe()
            if self._terminal is not None:
                with contextlib.suppress(ValueError):
                    asyncio.get_running_loop().remove_reader(self._terminal)
                os.close(self._terminal)
                self._terminal = None
            exit_code = 128 - code if code < 0 else code
            with contextlib.suppress(Exception):
                await self.nc.publish(self._subject("exit"), encode(SessionExited(exit_code=exit_code)))
            self._log.info("agent.session_exited", exit_code=exit_code)

    async def _publish_output(self) -> None:
        # One publisher on one connection: the chunks reach subscribers in the order they were read.
        try:
            async for chunk in self._output():
                await self.nc.publish(self._subject("out"), chunk)
        except Exception as exc:  # NATS gone: the session still ends, and says so when it can
            self._log.warning("agent.session_output_lost", error=repr(exc))

    def _output(self) -> AsyncIterator[bytes]:
        if self._terminal is not None:
            return self._terminal_output(self._terminal)
        return self._pipe_output()

    async def _pipe_output(self) -> AsyncIterator[bytes]:
        assert self.proc is not None and self.proc.stdout is not None
        while chunk := await self.proc.stdout.read(CHUNK_BYTES):
            yield chunk

    async def _terminal_output(self, terminal: int) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            try:
                chunk = os.read(terminal, CHUNK_BYTES)
            except BlockingIOError:
                return
            except OSError:  # EIO: every process holding the terminal's user side is gone
                chunk = b""
            if not chunk:
                loop.remove_reader(terminal)
            chunks.put_nowait(chunk)

        loop.add_reader(terminal, readable)
        while chunk := await chunks.get():
            yield chunk

    # --- input and control -----------------------------------------------------------------------

    async def _on_input(self, msg: Msg) -> None:
        self._inbox.put_nowait(msg.data)  # one queue for input and control keeps their order

    async def _on_control(self, msg: Msg) -> None:
        try:
            control = decode(msg.data, SessionControl)
        except Exception as exc:  # a client's mistake ends nothing
            self._log.warning("agent.session_bad_control", error=str(exc))
            return
        self._last_control = asyncio.get_running_loop().time()
        self._inbox.put_nowait(control)

    async def _feed_input(self) -> None:
        while True:
            item = await self._inbox.get()
            if isinstance(item, SessionControl):
                self._control(item)
            elif self._terminal is not None:
                await self._write_terminal(self._terminal, item)
            else:
                await self._write_pipe(item)

    def _control(self, control: SessionControl) -> None:
        if self._terminal is not None and (control.columns or control.rows):
            columns, rows = _size(self._terminal)
            with contextlib.suppress(OSError):
                _set_size(self._terminal, control.columns or columns, control.rows or rows)
        if control.close:
            if self._terminal is not None:
                with contextlib.suppress(OSError):
                    os.write(self._terminal, EOF_CHARACTER)
            elif self.proc is not None and self.proc.stdin is not None:
                self.proc.stdin.close()

    async def _write_pipe(self, data: bytes) -> None:
        stdin = self.proc.stdin if self.proc is not None else None
        if stdin is None or stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError):  # the command no longer reads its input
            stdin.write(data)
            await stdin.drain()

    async def _write_terminal(self, terminal: int, data: bytes) -> None:
        while data:
            try:
                written = os.write(terminal, data)
            except BlockingIOError:  # the terminal's input buffer is full: the program reads slowly
                await asyncio.sleep(0.01)
                continue
            except OSError:
                return
            data = data[written:]

    async def _watch_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while (left := self._last_control + self.request.idle_seconds - loop.time()) > 0:
            await asyncio.sleep(left)
        self._log.info("agent.session_idle", idle_seconds=self.request.idle_seconds)
        self.kill()

    async def _unsubscribe(self) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
