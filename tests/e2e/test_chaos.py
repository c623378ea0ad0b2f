"""A short chaos drill (devstack/chaos.py; the long one is bench/chaos.py): jobs run while the active
scheduler and launcher are killed -9 beside their standbys, NATS is killed -9 and started again, and a node
agent is killed -9 and started again. No acknowledged job is lost, none runs twice, each ends as its
processes did, and the services rebuild the same state from their logs."""

from __future__ import annotations

import pytest

from devstack.chaos import Drill, job_mix
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]
JOBS = 16


async def test_a_short_chaos_drill_loses_no_job_and_runs_none_twice(stack: Stack, database_url: str) -> None:
    drill = Drill(stack, database_url, postgres=None, progress=print)
    faults = drill.faults(services=["scheduler", "launcher"], nats=True, agents=1, postgres=False)

    report = await drill.run(job_mix(JOBS), faults, fault_every=4.0, end_timeout=180)

    assert report.problems == []
    assert report.unacknowledged == []
    assert sum(report.statuses.values()) == JOBS  # every one ended
    assert report.statuses["failed"] >= JOBS // 10  # the ones meant to fail did
    assert [r.fault for r in report.recoveries if r.seconds is None] == []
