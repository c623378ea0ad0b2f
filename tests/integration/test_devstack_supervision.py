"""The local stack's supervisor as `make up` runs it, with stand-in commands for the services: a
killed process is started again, logged, shown by `make status` under its new pid, and `make down`
stops it all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devstack.processes import alive
from devstack.stack import REPO_ROOT, ProcessSet

# A supervisor of two stand-in services that only sleep, started by `ProcessSet` as `up` starts the real one.
SUPERVISOR = """
import sys
from pathlib import Path
from devstack.stack import ProcessSet
from devstack.supervisor import Program, supervise
from libs.telemetry.logs import configure_logging

configure_logging("supervisor")
home = Path(sys.argv[1])
processes = ProcessSet(home, {})
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
supervise(home / "run", [Program(name, lambda name=name: processes.start(name, sleeper))
                         for name in ("scheduler", "launcher")])
"""
WAIT_SECONDS = 60


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {WAIT_SECONDS}s")
        time.sleep(0.1)


def recorded_pid(home: Path, name: str) -> int | None:
    try:
        return int((home / "run" / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def devstack(home: Path, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devstack", command], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, "TRAINYARD_HOME": str(home)})


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    supervisor = ProcessSet(home, {}).start("supervisor", [sys.executable, "-c", SUPERVISOR, str(home)])
    wait_for(lambda: (home / "run" / "supervisor.json").exists(), "the supervisor's first record")
    yield home
    if supervisor.poll() is None:  # the test failed before `down`: stop what it started
        supervisor.send_signal(signal.SIGTERM)
    supervisor.wait(timeout=60)


def test_a_killed_service_is_restarted_and_status_and_down_know_it(home: Path) -> None:
    first = recorded_pid(home, "scheduler")
    assert first is not None and alive(first)
    os.kill(first, signal.SIGKILL)

    def restarted() -> bool:
        pid = recorded_pid(home, "scheduler")
        return pid is not None and pid != first and alive(pid)

    wait_for(restarted, "the scheduler's restart")
    second = recorded_pid(home, "scheduler")
    assert second is not None
    log = [json.loads(line) for line in (home / "logs" / "supervisor.log").read_text().splitlines()
           if line.startswith("{")]
    exits = [line for line in log if line["event"] == "supervisor.exited"]
    assert [(line["process"], line["pid"], line["exit_code"]) for line in exits] == [("scheduler", first, -9)]
    assert any(line["event"] == "supervisor.restarted" and line["pid"] == second for line in log)

    status = devstack(home, "status")
    assert status.returncode == 0, status.stderr
    lines = {line.split()[0]: line for line in status.stdout.splitlines()}
    assert f"pid {second}, restarted once, last exit code -9" in lines["scheduler"]
    assert "running" in lines["scheduler"] and "running" in lines["launcher"] and "running" in lines["supervisor"]

    launcher = recorded_pid(home, "launcher")
    supervisor = recorded_pid(home, "supervisor")
    down = devstack(home, "down")
    assert down.returncode == 0, down.stderr
    assert "the stack is down" in down.stdout
    assert not any(alive(pid) for pid in (second, launcher, supervisor) if pid is not None)
    assert list((home / "run").glob("*.pid")) == []
    assert devstack(home, "status").stdout.strip() == "the stack is not running"
