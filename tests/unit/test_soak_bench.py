"""The soak benchmark's figures: where it samples, the cycle quantiles it reads from a histogram, and which samples
its memory growth compares; and its open flow of submissions."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from bench.soak import (
    Flow,
    evenly,
    growth_percent,
    histogram_buckets,
    histogram_quantile,
    kept_for_index,
    steady_stretch,
    warm_up_index,
)
from client.api import TrainyardClient

SCRAPED = """# HELP trainyard_scheduler_cycle_duration_seconds How long a scheduling cycle took
# TYPE trainyard_scheduler_cycle_duration_seconds histogram
trainyard_scheduler_cycle_duration_seconds_bucket{le="0.01",otel_scope_name="trainyard"} 10.0
trainyard_scheduler_cycle_duration_seconds_bucket{le="0.025",otel_scope_name="trainyard"} 90.0
trainyard_scheduler_cycle_duration_seconds_bucket{le="0.05",otel_scope_name="trainyard"} 100.0
trainyard_scheduler_cycle_duration_seconds_bucket{le="+Inf",otel_scope_name="trainyard"} 100.0
trainyard_scheduler_cycle_duration_seconds_count{otel_scope_name="trainyard"} 100.0
trainyard_scheduler_prediction_duration_seconds_bucket{le="0.01",otel_scope_name="trainyard"} 7.0
"""


def test_samples_and_restarts_are_spread_evenly_by_jobs() -> None:
    assert evenly(1000, 4, last=True) == [250, 500, 750, 1000]
    assert evenly(1000, 4, last=False) == [200, 400, 600, 800]  # none at the very end


def test_cycle_quantiles_are_interpolated_within_the_histogram_buckets() -> None:
    buckets = histogram_buckets(SCRAPED, "trainyard_scheduler_cycle_duration_seconds")
    assert buckets == {0.01: 10.0, 0.025: 90.0, 0.05: 100.0, float("inf"): 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.01 + 0.015 * 40 / 80)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.025 + 0.025 * 9 / 10)
    assert histogram_quantile({0.01: 0.0, float("inf"): 0.0}, 0.5) is None  # no cycle in the window
    assert histogram_quantile({0.01: 1.0, float("inf"): 5.0}, 0.99) == 0.01  # beyond every finite bound


def test_growth_starts_after_the_warm_up_once_jobs_are_archived() -> None:
    points = [(100, 0), (200, 0), (300, 0), (400, 50), (500, 150)]
    assert warm_up_index(points, 200) == 3  # past 200 jobs, but nothing archived until the fourth
    assert warm_up_index([(100, 0), (200, 0)], 150) == 1  # never archived: the first past the warm-up
    assert growth_percent(100.0, 109.0) == pytest.approx(9.0)


def test_the_agent_is_compared_from_the_first_sample_once_it_forgets_what_ended_as_fast_as_it_ends() -> None:
    seconds = [600.0, 1800.0, 3599.0, 3600.0, 4200.0]
    assert kept_for_index(seconds, 1, 3600.0) == 3  # an hour in: what ended at the start is being forgotten
    assert kept_for_index(seconds, 4, 3600.0) == 4  # never before the warm-up
    assert kept_for_index(seconds[:3], 0, 3600.0) is None  # the run was shorter than what it keeps


def test_a_restarted_process_is_compared_over_its_longest_stretch_without_a_restart() -> None:
    restarted = [False, False, False, False, True, False, False, False, False, True, False, False]
    # Samples 1-3 before the first restart, 5-8 after it (4 is the restarted process's first), 10-11 after the second.
    assert steady_stretch(restarted, 1) == (5, 8)
    assert steady_stretch([False, True, True], 0) is None


class StalledStack:
    """Answers no submission until `resume` is set (a restarted scheduler catching up), then each at once; notes
    when each submission was sent."""

    def __init__(self) -> None:
        self.resume = asyncio.Event()
        self.sent: list[float] = []

    async def submit(self, spec: Any, *, job_id: str) -> None:
        self.sent.append(time.monotonic())
        await self.resume.wait()


@pytest.mark.asyncio
async def test_an_open_flow_kept_behind_goes_on_at_its_rate_rather_than_catching_up() -> None:
    """Users do not submit faster because the platform was slow a moment: a flow of 50 jobs a second held up for
    half a second (its 4 submissions out unanswered) sends the next ones 20 ms apart once answers come again, not
    the 25 it fell behind by at once."""
    stack = StalledStack()
    flow = Flow(cast(TrainyardClient, stack), jobs=60, agent_every=0, rate=50)
    flowing = asyncio.ensure_future(flow.run(in_flight=4))
    await asyncio.sleep(0.5)
    assert len(stack.sent) == 4
    released = time.monotonic()
    stack.resume.set()
    await asyncio.sleep(0.1)
    assert len([sent for sent in stack.sent if sent >= released]) <= 8  # (0.1 s at 50 a second: about 5)
    await flowing
    assert flow.submitted == 60
