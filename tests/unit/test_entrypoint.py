"""`libs.skeleton.entrypoint.run`: how a service or agent process ends, as a supervisor sees it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent("""
    import asyncio, sys
    from libs.skeleton.entrypoint import run

    class Process:
        async def stopped(self) -> None:
            if sys.argv[1] == "crash":
                await asyncio.sleep(0.2)
                return
            print("waiting", flush=True)  # asked once the signal handlers are set
            await asyncio.Event().wait()

        async def close(self) -> None:
            print("closed", flush=True)

    async def start() -> Process:
        import gc
        if sys.argv[1] == "slow-start":  # a standby waiting for its lease, say
            print("starting", flush=True)
            await asyncio.Event().wait()
        print("started", flush=True)
        print("young collections every", gc.get_threshold()[0], flush=True)
        return Process()

    run("test", start)
""")


def start(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    return subprocess.Popen([sys.executable, str(program), mode], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_process_asked_to_stop_closes_and_exits_zero(tmp_path: Path, sig: signal.Signals) -> None:
    process = start(tmp_path, "serve")
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "started"
    line = process.stdout.readline()  # the signal handlers are set once the factory returned
    while line and line.strip() != "waiting":
        line = process.stdout.readline()
    assert line, "the process ended before it waited to be asked to stop"
    process.send_signal(sig)
    assert process.wait(timeout=20) == 0
    # Read on through the same buffered reader: communicate() would read the pipe beneath it and miss what
    # the readline above took in with its line (the rest of a line the program wrote in pieces).
    out = process.stdout.read()
    assert [line for line in out.splitlines() if not line.startswith("young")] == ["closed"]


def test_a_process_asked_to_stop_while_it_starts_exits_zero(tmp_path: Path) -> None:
    """A SIGTERM before the process is up (a rollout that changes its mind, a standby never promoted) ends it in
    order, not by the signal's default action (exit -15)."""
    process = start(tmp_path, "slow-start")
    assert process.stdout is not None
    line = process.stdout.readline()
    while line and line.strip() != "starting":
        line = process.stdout.readline()
    assert line, "the process ended before it started"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert "started" not in process.stdout.read()


def test_a_process_that_stops_on_its_own_closes_and_exits_non_zero(tmp_path: Path) -> None:
    process = start(tmp_path, "crash")
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 1  # a supervisor restarts it
    assert [line for line in out.splitlines() if not line.startswith("young")] == ["started", "closed"]


def test_a_process_collects_its_young_objects_less_often_than_python_does(tmp_path: Path) -> None:
    """A service or agent drops many short-lived objects a message: its cycle collector runs every
    YOUNG_COLLECTION_ALLOCATIONS allocations rather than every 700 (about a tenth of a service's CPU)."""
    from libs.skeleton.entrypoint import YOUNG_COLLECTION_ALLOCATIONS

    out, _ = start(tmp_path, "crash").communicate(timeout=20)
    assert f"young collections every {YOUNG_COLLECTION_ALLOCATIONS}" in out
    assert YOUNG_COLLECTION_ALLOCATIONS > 700
