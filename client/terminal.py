"""Debug sessions (J15) at the user's terminal: `trainyard exec` and the client's `session()`.

The session itself (opening it through the monitor, its output, input, size and exit) is
libs/messaging/debug_session.py, which the gateway's web terminal speaks too; here is what only a
program at a terminal needs: the command line, raw mode, the terminal's size and the exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shlex
import shutil
import signal
import sys
import termios
import tty
from collections.abc import Sequence
from typing import Any, BinaryIO

from libs.messaging.debug_session import CHUNK, KEEPALIVE_SECONDS, DebugSession, open_session

__all__ = ["CHUNK", "KEEPALIVE_SECONDS", "DebugSession", "attach", "command_line", "exit_status", "open_session",
           "terminal_size"]


def command_line(words: Sequence[str]) -> str | None:
    """The command to run: one word as given (it may be a whole shell line), several words quoted
    so that the shell sees them as they were typed; None (a shell) for none."""
    if not words:
        return None
    return words[0] if len(words) == 1 else shlex.join(words)


def exit_status(code: int) -> int:
    """A remote exit code as this process's exit status: a signal -N reads 128+N, as in a shell."""
    if code < 0:
        code = 128 - code
    return min(code, 255)


# --- the terminal side (the CLI) -------------------------------------------------------------------


def terminal_size(fd: int | None = None) -> tuple[int, int]:
    """Columns and rows of the terminal on `fd`, else the one the user sits at (80x24 when none)."""
    for candidate in (fd, _fileno(sys.stdin), _fileno(sys.stdout)):
        if candidate is not None:
            with contextlib.suppress(OSError):
                size = os.get_terminal_size(candidate)
                return size.columns, size.lines
    size = shutil.get_terminal_size()
    return size.columns, size.lines


def _fileno(stream: object) -> int | None:
    try:
        return stream.fileno()  # type: ignore[attr-defined,no-any-return]
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return None


async def _forward_input(session: DebugSession, stdin: BinaryIO) -> None:
    """Send stdin to the session as it is typed or piped; close its input at end-of-file."""
    loop = asyncio.get_running_loop()
    fd = _fileno(stdin)
    if fd is not None:
        pieces: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
            pieces.put_nowait(data)

        try:
            loop.add_reader(fd, readable)
        except PermissionError:
            pass  # a regular file (`< file`): it never blocks, so it is read directly below
        else:
            try:
                while data := await pieces.get():
                    await session.send(data)
            finally:
                loop.remove_reader(fd)
            await session.close_input()
            return
    while data := stdin.read(CHUNK):
        await session.send(data)
        await asyncio.sleep(0)  # let output through while a large file is sent
    await session.close_input()


async def attach(session: DebugSession, *, stdin: BinaryIO | None, raw: bool = False,
                 stdout: BinaryIO | None = None) -> int:
    """Connect the session to this terminal until it exits, and return its exit code.

    What comes on `stdin` is sent until its end, which closes the session's input (None: closed at
    once). `raw` puts a terminal stdin in raw mode, so that every key (Ctrl-C included) goes to the
    remote shell, and sends the terminal's size, now and whenever it changes.
    """
    stdout = stdout if stdout is not None else sys.stdout.buffer
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    restore: list[list[Any]] = []
    fd = _fileno(stdin) if stdin is not None else None
    resizing = False
    try:
        if raw and fd is not None:
            restore.append(termios.tcgetattr(fd))
            tty.setraw(fd)
            await session.resize(*terminal_size(fd))

            def on_resize() -> None:
                task = loop.create_task(session.resize(*terminal_size(fd)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            loop.add_signal_handler(signal.SIGWINCH, on_resize)
            resizing = True
        if stdin is not None:
            tasks.add(loop.create_task(_forward_input(session, stdin)))
        else:
            await session.close_input()
        async for chunk in session.output():
            stdout.write(chunk)
            stdout.flush()
    finally:
        if resizing:
            loop.remove_signal_handler(signal.SIGWINCH)
        for task in tasks:
            task.cancel()
        if restore and fd is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, restore[0])
    if session.exit_code is None:
        raise ConnectionError(f"session {session.session_id} on {session.node} ended without an exit code")
    return session.exit_code
