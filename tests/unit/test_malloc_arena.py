"""Every long-running process allocates from one malloc arena (`entrypoint.one_malloc_arena`): what a worker thread
frees serves the event loop's later allocations. The scheduler restores its snapshot in a worker thread; with an
arena per thread it kept the memory of that restore's buffers for the rest of its life."""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import textwrap
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import pytest

from libs.skeleton import entrypoint

ROOT = Path(__file__).resolve().parents[2]

# A scheduler's state of 8,000 queued jobs saved, restored in a worker thread, and the event loop's thread then
# making and dropping objects as a service does; the resident MiB at the end.
RESTORE_IN_A_THREAD = textwrap.dedent("""
    import gc, sys, threading
    from libs.skeleton.entrypoint import one_malloc_arena
    if sys.argv[1] == "one":
        assert one_malloc_arena()
    from services.scheduler.history.past_snapshots import dump, load
    from services.scheduler.planning.prediction_cache import PredictionCache
    from tests.support.scheduler_state import Fold
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    for n in range(8000):
        fold.job(f"job-{n:012x}", f"run-{n}", ["a100-4", "a100-1"], duration="2h")
    data = dump(fold.state, PredictionCache(), {})
    del fold
    gc.collect()
    kept = []
    worker = threading.Thread(target=lambda: kept.append(load(data)))
    worker.start()
    worker.join()
    del data
    for round in range(200):
        made = [bytearray(2000) for _ in range(5000)] + [dict(a=1, b=str(round)) for _ in range(5000)]
    del made
    gc.collect()
    print(next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS")))
""")


def resident_mib(arenas: str) -> int:
    done = subprocess.run([sys.executable, "-c", RESTORE_IN_A_THREAD, arenas], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=120)
    return int(done.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_a_state_restored_in_a_worker_thread_leaves_no_memory_behind_with_one_arena() -> None:
    per_thread, one = resident_mib("per-thread"), resident_mib("one")
    assert one <= per_thread - 5, (one, per_thread)


def test_every_process_run_by_the_entrypoint_has_one_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` sets it before anything else runs (no thread is made yet)."""
    order: list[str] = []

    def arena() -> bool:
        order.append("one arena")
        return True

    def serve(main: Coroutine[Any, Any, None]) -> None:
        main.close()
        order.append("served")

    monkeypatch.setattr(entrypoint, "one_malloc_arena", arena)
    monkeypatch.setattr(asyncio, "run", serve)
    entrypoint.run("tests", cast(Any, None))
    assert order == ["one arena", "served"]
