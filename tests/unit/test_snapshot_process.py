"""The process that makes the scheduler's snapshots makes none when its code is not the scheduler's (changed on disk
since the scheduler started): it would write snapshots the scheduler cannot read, and drop those it can."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.scheduler.history import snapshot_process

ROOT = Path(__file__).resolve().parents[2]


def test_a_process_of_other_code_than_the_schedulers_makes_no_snapshot() -> None:
    done = subprocess.run(
        [sys.executable, "-m", snapshot_process.__name__, "--at", "2026-12-03T09:00:00+00:00", "--format", "0" * 16],
        cwd=ROOT, input=b"", capture_output=True, timeout=60,
        env={"NATS_URL": "nats://127.0.0.1:1", "DATABASE_URL": "postgresql://127.0.0.1:1/none", "PATH": ""})
    assert done.returncode == snapshot_process.CODE_CHANGED
    assert b"the scheduler's code changed since it started" in done.stderr
