"""`libs.entrypoint.run`: how a service or agent process ends, as a supervisor sees it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent("""
    import asyncio, sys
    from libs.entrypoint import run

    class Process:
        async def stopped(self) -> None:
            if sys.argv[1] == "crash":
                await asyncio.sleep(0.2)
                return
            await asyncio.Event().wait()

        async def close(self) -> None:
            print("closed", flush=True)

    async def start() -> Process:
        print("started", flush=True)
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
    time.sleep(0.2)  # the signal handlers are set once the factory returned
    process.send_signal(sig)
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 0
    assert out.split() == ["closed"]


def test_a_process_that_stops_on_its_own_closes_and_exits_non_zero(tmp_path: Path) -> None:
    process = start(tmp_path, "crash")
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 1  # a supervisor restarts it
    assert out.split() == ["started", "closed"]
