"""What `status` shows and `down` stops: every process the local stack recorded under `run/`.

The supervisor rewrites run/<name>.pid at every (re)start of a service or agent and keeps
run/supervisor.json (devstack/supervisor.py); `up` records nats.pid; PostgreSQL records its own
postmaster.pid. A pid is alive when its process exists and is not a zombie.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from devstack.supervisor import PID_NAME, STATE_FILE

NATS = "nats"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def recorded_pids(run_dir: Path) -> dict[str, int]:
    pids = {}
    for pid_file in sorted(run_dir.glob("*.pid")) if run_dir.exists() else []:
        with contextlib.suppress(ValueError, OSError):
            pids[pid_file.stem] = int(pid_file.read_text().strip())
    return pids


def supervisor_state(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each supervised process's pid, restarts, last exit code and next start (wall clock), by name."""
    try:
        processes: dict[str, dict[str, Any]] = json.loads((run_dir / STATE_FILE).read_text())["processes"]
        return processes
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def postgres_pid(postgres_dir: Path) -> int | None:
    """The stack's own PostgreSQL server, while it runs (pg_ctl keeps its pid on the first line)."""
    try:
        return int((postgres_dir / "pgdata" / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    running: bool
    detail: str


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def _supervised_detail(pid: int | None, running: bool, state: dict[str, Any], now: float) -> str:
    parts = [f"pid {pid}"] if running else []
    restarts, exit_code, restart_at = state.get("restarts", 0), state.get("exit_code"), state.get("restart_at")
    if not running and exit_code is not None:
        parts.append(f"exit code {exit_code}")
    if not running and restart_at is not None:
        parts.append(f"restarting in {max(0, round(restart_at - now))}s")
    if restarts:
        parts.append(f"restarted {_times(restarts)}" + (f", last exit code {exit_code}" if running else ""))
    return ", ".join(parts)


def _is_nats(name: str) -> bool:
    """A NATS server's record: `nats`, or `nats-<i>` of a cluster."""
    return name == NATS or (name.startswith(f"{NATS}-") and name[len(NATS) + 1:].isdigit())


def stack_processes(home: Path, now: float | None = None) -> list[ProcessStatus]:
    """The supervisor, what it supervises, any other recorded process, NATS and PostgreSQL, in that order."""
    now = time.time() if now is None else now
    run_dir = home / "run"
    pids, supervised = recorded_pids(run_dir), supervisor_state(run_dir)
    found: list[ProcessStatus] = []
    if PID_NAME in pids:
        running = alive(pids[PID_NAME])
        found.append(ProcessStatus(PID_NAME, running, f"pid {pids[PID_NAME]}" if running else
                                   "exited: nothing restarts the others; `make down`, then `make up`"))
    others = [name for name in pids if name not in supervised and name != PID_NAME and not _is_nats(name)]
    for name in [*supervised, *others]:
        pid = pids.get(name)
        running = pid is not None and alive(pid)
        detail = _supervised_detail(pid, running, supervised.get(name, {}), now)
        found.append(ProcessStatus(name, running, detail or ("exited" if not running else "")))
    for name in sorted(name for name in pids if _is_nats(name)):  # one server, or a cluster's nats-1, nats-2...
        running = alive(pids[name])
        found.append(ProcessStatus(name, running, f"pid {pids[name]}" if running else "exited"))
    if (pg := postgres_pid(home / "postgres")) is not None:
        running = alive(pg)
        found.append(ProcessStatus("postgres", running, f"pid {pg}" if running else "exited"))
    return found


def _terminate(pids: dict[str, int], timeout: float) -> None:
    """SIGTERM each live process's group, wait up to `timeout` for them all, SIGKILL what is left."""
    pids = {name: pid for name, pid in pids.items() if alive(pid)}  # a dead one's pid may be another's now
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.1)
    for pid in pids.values():
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def stop_recorded(run_dir: Path, *, timeout: float = 15.0) -> list[str]:
    """Stop every recorded process, the names of which it returns: the supervisor first (so nothing is
    restarted; it stops what it supervises), then what is still recorded (left by a supervisor that
    died), NATS last. Their pid files are removed."""
    stopped: list[str] = []
    for group in (lambda name: name == PID_NAME, lambda name: not _is_nats(name), lambda name: True):
        pids = {name: pid for name, pid in recorded_pids(run_dir).items() if group(name)}
        # The supervisor waits `timeout` for its processes, then kills them: give it that and a little more.
        _terminate(pids, timeout + 10 if PID_NAME in pids else timeout)
        for name in pids:
            (run_dir / f"{name}.pid").unlink(missing_ok=True)
        stopped.extend(pids)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def forget_stopped(run_dir: Path) -> None:
    """Remove the records of processes that no longer run, so `status` lists none of them."""
    for name, pid in recorded_pids(run_dir).items():
        if not alive(pid):
            (run_dir / f"{name}.pid").unlink(missing_ok=True)
    if not (run_dir / f"{PID_NAME}.pid").exists():
        (run_dir / STATE_FILE).unlink(missing_ok=True)
