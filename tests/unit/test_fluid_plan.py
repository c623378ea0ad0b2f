"""S6 deep in the queue: past the jobs planned one by one, a rough start from the work ahead (fluid_plan.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec
import pytest

from libs.placement import NodeCapacity, QueuedJob, RunningJob
from services.scheduler.planning import playthrough
from services.scheduler.planning.prediction import ROUGH, plan_queue, predict
from tests.support.placement import FLAVORS, NOW, busy, node, queued, run_on, spec

HOUR = 3600


def at(hours: float) -> datetime:
    return NOW + timedelta(hours=hours)


def full_cluster() -> tuple[list[NodeCapacity], list[RunningJob]]:
    """Four nodes of 4 CPUs, each running a job for another hour."""
    nodes = [node(n, cpus=4) for n in "abcd"]
    running = [run_on(f"r-{n}", [n], ends_in=HOUR) for n in "abcd"]
    return busy(nodes, running), running


def hour_jobs(count: int, prefix: str = "job") -> list[QueuedJob]:
    return [queued(f"{prefix}-{k:02}", duration=HOUR) for k in range(count)]


@pytest.fixture
def planned_one_by_one(monkeypatch: pytest.MonkeyPatch) -> int:
    """One simulated cycle, then four jobs planned one by one; the rest poured."""
    monkeypatch.setattr(playthrough, "SIMULATION_NODE_CYCLES", 1)
    monkeypatch.setattr(playthrough, "HORIZON_NODE_JOBS", 4 * 4)
    return 4


def test_deep_jobs_start_within_a_job_of_the_exact_plan_and_never_earlier(planned_one_by_one: int) -> None:
    nodes, running = full_cluster()
    queue = hour_jobs(40)
    plans = plan_queue(queue, nodes, FLAVORS, running=running, now=NOW)
    rough = [job.job_id for job in queue if plans[job.job_id].rough]
    assert len(rough) > 30  # past the playthrough's cycle and the jobs planned one by one
    for index, job in enumerate(queue):
        exact = at(1 + index // 4)  # four at a time, each an hour, once the running jobs end
        start = plans[job.job_id].start
        assert start is not None and exact <= start < exact + timedelta(hours=1), job.job_id
    starts = [start for job_id in rough if (start := plans[job_id].start) is not None]
    assert starts == sorted(starts)  # further back is never sooner


def test_a_new_job_deep_in_the_queue_is_told_its_start_is_rough(planned_one_by_one: int) -> None:
    nodes, running = full_cluster()
    prediction = predict(spec(1), hour_jobs(40), nodes, FLAVORS, running=running, now=NOW, duration_seconds=HOUR)
    assert prediction.estimated_start is not None
    assert at(11) <= prediction.estimated_start < at(12)  # 40 hour-long jobs ahead on 4 nodes, from 10:00
    assert ROUGH in prediction.reason and "expected to start around" in prediction.reason
    assert prediction.jobs_ahead == 40


def test_jobs_without_a_limit_ahead_hold_their_share_for_good(planned_one_by_one: int) -> None:
    nodes, running = full_cluster()
    half = [*hour_jobs(8), queued("forever-1"), queued("forever-2"), *hour_jobs(8, "after")]
    plans = plan_queue(half, nodes, FLAVORS, running=running, now=NOW)
    # Two of the four nodes are held for good from about 11:00: the eight jobs behind take twice as long.
    assert plans["after-07"].start is not None and plans["after-07"].start >= at(6)
    everything = [*hour_jobs(8), *(queued(f"forever-{k}") for k in range(4)), *hour_jobs(2, "after")]
    plans = plan_queue(everything, nodes, FLAVORS, running=running, now=NOW)
    assert plans["forever-3"].start is not None  # the last of them still finds its share
    assert plans["after-00"].start is None  # nothing is left for good for the jobs behind them
    one_more = predict(spec(1), everything, nodes, FLAVORS, running=running, now=NOW, duration_seconds=HOUR)
    assert one_more.estimated_start is None and "jobs without a duration limit" in one_more.reason
    # A job without a limit that would not have room for good takes nothing: the node left still runs jobs.
    too_big = [*hour_jobs(8), *(queued(f"forever-{k}") for k in range(3)), queued("forever-wide", 2),
               *hour_jobs(2, "after")]
    plans = plan_queue(too_big, nodes, FLAVORS, running=running, now=NOW)
    assert plans["forever-wide"].start is None and plans["after-01"].start is not None


def test_a_rough_start_is_never_before_the_job_fits_behind_the_jobs_planned_one_by_one(
        planned_one_by_one: int) -> None:
    nodes = [node(n, cpus=4) for n in "abcd"]
    running = [*(run_on(f"r-{n}", [n], ends_in=HOUR) for n in "abc"), run_on("r-d", ["d"], ends_in=10 * HOUR)]
    # The work ahead would fit on three nodes by about 13:00, but a job of four nodes must wait for d.
    prediction = predict(spec(4), hour_jobs(8), busy(nodes, running), FLAVORS, running=running, now=NOW,
                         duration_seconds=HOUR)
    assert prediction.estimated_start is not None and prediction.estimated_start >= at(10)


def test_a_job_submitted_deep_in_the_queue_moves_the_rough_starts_behind_it(planned_one_by_one: int) -> None:
    nodes, running = full_cluster()
    urgent = [msgspec.structs.replace(job.spec, priority="urgent") for job in hour_jobs(10, "u")]
    queue = [*(QueuedJob(f"u-{k:02}", job_spec, HOUR) for k, job_spec in enumerate(urgent)), *hour_jobs(20)]
    kept = playthrough.Playthrough(nodes, FLAVORS, running=running, queue=queue, now=NOW)
    newcomer = QueuedJob("new", spec(1), HOUR)
    before = kept.new_job(newcomer)
    # An urgent job joins behind the other urgent ones, past the jobs planned one by one, ahead of the normal ones.
    joined = QueuedJob("u-late", urgent[0], 4 * HOUR)
    kept.join(joined)
    after = kept.new_job(newcomer)
    fresh = playthrough.Playthrough(nodes, FLAVORS, running=running, queue=[*queue[:10], joined, *queue[10:]], now=NOW)
    assert after == fresh.new_job(newcomer)
    assert before.start is not None and after.start is not None and after.start > before.start
