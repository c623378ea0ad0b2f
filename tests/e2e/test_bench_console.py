"""bench/console.py, short: on the whole stack with its gateway, every figure of the console's benchmark comes out
and makes sense (the rows each request showed, lines followed, followers fed, CPU found for the gateway)."""

from __future__ import annotations

import pytest

from bench.console import Plan, measure
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]


async def test_the_console_benchmark_produces_every_figure(stack: Stack) -> None:
    plan = Plan(jobs=200, samples=20, follow_seconds=4, followers=4, pairs=1, submits=50)
    figures = await measure(stack, plan, print)

    assert figures.queued == 200
    rows = {name: timed.rows for name, timed in figures.requests.items()}
    assert rows == {"GET /jobs": 50, "GET /jobs?page=4": 50, "GET /jobs, name 'held-123'": 1,
                    "POST /api/v1/search-jobs, 50": 50, "POST /api/v1/list-jobs, 200": 200}
    for timed in figures.requests.values():
        assert len(timed.seconds) == 20 and min(timed.seconds) > 0
    # The gateway is a role of its own in the CPU tables: its process served every one of those requests.
    assert sum(timed.spent.by_role.get("gateway", 0.0) for timed in figures.requests.values()) > 0

    streamed = figures.follow["sse"]
    assert streamed.seen and min(streamed.seen) > 0  # seen after it was printed, on the same clock
    if "browser" in figures.follow:
        shown = figures.follow["browser"]
        assert shown.seen and len(shown.entered) == len(shown.seen)
        assert all(0 < entered <= seen for entered, seen in zip(shown.entered, shown.seen, strict=True))
    else:
        assert figures.follow_note

    assert [run.followers for run in figures.runs] == [0, 4]
    assert all(run.accepted == 50 and run.rate > 0 for run in figures.runs)
    # Every status follower has the job's status at once; every log follower the lines so far.
    assert figures.runs[0].alone is None and figures.runs[1].alone is not None
    followed = figures.runs[1].events
    assert followed["status"] >= 2 and followed["log"] >= 2 and not followed["error"]
