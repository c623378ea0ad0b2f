"""The holder of one node's command: what lets a job outlive its agent (as slurmstepd outlives slurmd).

The agent starts a holder per rank, in a session of its own, and gives it the command through a spec
file in the rank's folder. The holder starts the command (in a session and process group of its own,
so a stop reaches every child it forks), points its output at the folder's `output.log`, waits for it
and writes its exit code to `exit.json`. Nothing of the command hangs on the agent: no pipe breaks when
the agent is killed or restarted, and a new agent adopts the command from these files (agent/held.py):
it ships the output from where the last one stopped and reports the exit when it comes.

Run as `python -I -S holder.py <rank folder>`: standard library only, so that it needs no installed
package and reads no PYTHON* variable. It carries none of the job's TRAINYARD_* variables itself, so a
stop that kills every process of the attempt leaves it alive to record the exit.

Starting a Python for each holder costs more than the whole rest of a short job's start (about 20 ms of
CPU), so an agent runs one holder server (`holder.py --serve`, in a session of its own) that forks a
holder for each rank folder it is given on its standard input, and answers with the holder's pid and
start time. The server outlives its agent until the last of its holders ended, reaping them, so no
holder is left a zombie; a restarted agent starts a server of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

SPEC_NAME = "holder-spec.json"  # argv, env and cwd; removed once read (the job's secrets are in it)
PID_NAME = "job.pid"  # the command's pid, which is its process group's id too
OUTPUT_NAME = "output.log"
EXIT_NAME = "exit.json"  # {"exit_code": ..., "exited_at": ..., "started": ...}


def write_atomically(path: Path, text: str) -> None:
    """Readers see the whole file or none of it."""
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    partial.replace(path)


def exit_record(code: int, *, started: bool) -> str:
    # A process killed by signal N reports -N; shells report 128+N. Use the shell convention.
    return json.dumps({"exit_code": 128 - code if code < 0 else code, "started": started,
                       "exited_at": datetime.now(UTC).isoformat()})


def hold(folder: Path) -> int:
    spec_path = folder / SPEC_NAME
    spec = json.loads(spec_path.read_text())
    spec_path.unlink()
    with (folder / OUTPUT_NAME).open("ab") as output:
        try:
            child = subprocess.Popen(spec["argv"], env=spec["env"], cwd=spec["cwd"], stdin=subprocess.DEVNULL,
                                     stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            output.write(f"[trainyard] cannot start {spec['argv'][0]!r}: {exc}\n".encode())
            write_atomically(folder / EXIT_NAME, exit_record(127, started=False))
            return 0
    write_atomically(folder / PID_NAME, str(child.pid))
    code = child.wait()
    write_atomically(folder / EXIT_NAME, exit_record(code, started=True))
    return 0


def start_ticks(pid: int, *, ended: bool = False) -> int | None:
    """When `pid` started, in clock ticks since boot (None: no such process, or one that ended, unless
    `ended`: a child not reaped yet): with the pid, it names a process for as long as the system runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") and not ended else int(fields[19])


def _reaped() -> list[int]:
    """The holders that ended since the last look, reaped."""
    ended: list[int] = []
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append(pid)


def _forked(folder: Path) -> int:
    """Fork a holder for `folder`; in the child, hold its command and end."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the holder waits for its own command
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # the server's pipes are the agent's, not the holder's
                os.dup2(null, fd)
            code = hold(folder)
        finally:
            os._exit(code)
    return pid


def serve() -> int:
    """Fork a holder for each rank folder named on standard input (a line each), answering `started <pid>
    <start ticks>` on standard output, and tell `ended <pid>` when one ended (its exit recorded), so the
    agent learns it at once. Once the input ends (the agent is gone), wait for the holders, then end."""
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    pending, listening, holders, telling = b"", True, 0, True
    while listening or holders:
        lines: list[str] = []
        for key, _ in selector.select():
            if key.fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                continue
            data = os.read(0, 65536)
            if not data:
                listening = False
                selector.unregister(0)
            pending += data
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                pid = _forked(Path(line.decode()))
                holders += 1
                # Read before the holder is reaped (below), however soon it ended: a pid with its start time.
                lines.append(f"started {pid} {start_ticks(pid, ended=True) or 0}\n")
        for pid in _reaped():
            holders -= 1
            lines.append(f"ended {pid}\n")
        if lines and telling:
            try:
                os.write(1, "".join(lines).encode())
            except BrokenPipeError:  # the agent is gone: its holders are still reaped
                telling = False
    return 0


def main() -> int:
    # A terminal's hang-up or interrupt is not meant for the holder; a stop is sent to the command.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.argv[1] == "--serve":
        return serve()
    return hold(Path(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
