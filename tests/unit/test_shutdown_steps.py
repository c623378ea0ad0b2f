"""A service's shutdown is bounded step by step, and says which step held it up: one that hangs is given up after
its timeout, one that is slow is named, and the steps after them still run."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from libs.settings import Settings
from libs.skeleton import runtime


async def test_a_step_that_hangs_is_given_up_and_named() -> None:
    with capture_logs() as logs:
        await runtime._bounded("followers", lambda: asyncio.sleep(60), timeout=0.05)
    [line] = logs
    assert line["event"] == "service.stop_step_failed" and line["step"] == "followers"
    assert "not done within" in line["error"]


async def test_a_slow_step_is_named_and_a_quick_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "SLOW_STOP_SECONDS", 0.05)
    with capture_logs() as logs:
        await runtime._bounded("nats", lambda: asyncio.sleep(0.1), timeout=5)
        await runtime._bounded("lease", lambda: asyncio.sleep(0), timeout=5)
    [line] = logs
    assert line["event"] == "service.stop_step_slow" and line["step"] == "nats" and line["seconds"] >= 0.05


async def test_a_step_that_fails_does_not_stop_the_shutdown() -> None:
    async def broken() -> None:
        raise ConnectionError("NATS is gone")

    with capture_logs() as logs:
        await runtime._bounded("answering", broken, timeout=5)
    assert [(line["step"], line["error"]) for line in logs] == [("answering", "ConnectionError('NATS is gone')")]


async def test_a_background_task_that_ignores_its_cancellation_is_named_with_where_it_waits() -> None:
    rt = runtime.ServiceRuntime("tests", Settings())
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue

    rt.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    with capture_logs() as logs:
        await rt.close(timeout=0.05)
    release.set()
    # A runtime never started has nothing to stop answering, no connection and no lease: those steps are passed over.
    assert [line["step"] for line in logs if line["event"] == "service.stop_step_failed"] == ["background tasks"]
    [stuck] = [line for line in logs if line["event"] == "service.task_not_ended"]
    assert stuck["task"].endswith("stubborn") and any("test_shutdown_steps.py" in place for place in stuck["at"])


async def test_a_part_that_holds_the_stop_up_is_named_as_it_asked() -> None:
    """Several followers share one method's name: each is named after its consumer, so that a slow one is known."""
    rt = runtime.ServiceRuntime("tests", Settings())

    async def stop() -> None:
        await asyncio.sleep(60)

    async def quick() -> None:
        return None

    rt.on_close(quick, "following launcher-jobs")
    rt.on_close(stop, "following launcher-nodes")
    with capture_logs() as logs:
        await rt.close(timeout=0.05)
    assert [line["step"] for line in logs if line["event"] == "service.stop_step_failed"] == [
        "following launcher-nodes"]
