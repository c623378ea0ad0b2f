"""Scheduling decisions on the real stack: duration limits (J16, S11), elastic growth (S10), arrays, and the
scheduler's past told and replayed (`trainyard at`, `trainyard simulate`)."""

from __future__ import annotations

import asyncio
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from libs.contracts.events import JobAdmitted, JobRescaling
from libs.contracts.jobspec import CheckpointResume, Elastic, JobSpec
from libs.contracts.operations.planning import SimulationProgress
from tests.support.replay import start_differences
from tests.support.specs import sleeper
from tests.support.stack import Stack
from tests.support.waiting import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]
POOL_CLUSTER = Path(__file__).parent / "cluster-pool.yaml"


def with_changes(spec: JobSpec, **changes: object) -> JobSpec:
    import msgspec

    return msgspec.structs.replace(spec, **changes)


async def test_a_job_past_its_duration_limit_expires(stack: Stack) -> None:
    api = await stack.up()
    job = await api.submit(with_changes(sleeper("too-long", seconds=120), duration="3s"))
    ended = await stack.wait_until(job.job_id, "ended", timeout=60)
    assert ended.status == "expired"
    assert "duration limit of 3s" in (ended.reason or "")
    names = [type(e.event).name() for e in await api.history(job.job_id)]
    assert names.index("JobExpiring") < names.index("LaunchStopped") < names.index("JobExpired")


async def test_a_running_jobs_limit_changes_without_a_restart(stack: Stack) -> None:
    api = await stack.up()
    job = await api.submit(with_changes(sleeper("extended", seconds=6), duration="4s"))

    async def admitted() -> bool:  # the limit runs from the admission: changed then, not once the process runs
        return (await api.get_job(job.job_id)).job.status == "running"

    await eventually(admitted, timeout=60)
    await api.change_duration(job.job_id, "1m")
    running = await stack.wait_until(job.job_id, "running", timeout=60)
    ended = await stack.wait_until(job.job_id, "ended", timeout=60)
    assert ended.status == "succeeded", ended.reason
    assert ended.attempt == 1
    assert ended.instances[0].pid == running.instances[0].pid


@pytest.mark.cluster(POOL_CLUSTER)
async def test_a_shrunken_elastic_job_grows_when_nodes_free_up(stack: Stack) -> None:
    api = await stack.up()
    blocker = await api.submit(with_changes(sleeper("blocker", seconds=5), flavors=["cpu-2"], pool="elastic"))
    await stack.wait_until(blocker.job_id, "running", timeout=60)
    elastic = with_changes(sleeper("elastic", nodes=2, seconds=6), flavors=["cpu-2"], pool="elastic",
                           checkpoint_resume=CheckpointResume(elastic=Elastic(min_nodes=1)))
    job = await api.submit(elastic)
    first = await stack.wait_until(job.job_id, "running", timeout=60)
    assert len(first.placement) == 1  # admitted short, on the one free node

    ended = await stack.wait_until(job.job_id, "ended", timeout=90)
    assert ended.status == "succeeded", ended.reason
    assert ended.attempt == 2
    assert {p.node for p in ended.placement} == {"node-a", "node-b"}
    events = [e.event for e in await api.history(job.job_id)]
    growth = [e for e in events if isinstance(e, JobRescaling)]
    assert len(growth) == 1 and "from 1 to 2 nodes" in growth[0].reason
    assert [len(e.placement) for e in events if isinstance(e, JobAdmitted)] == [1, 2]


async def test_an_arrays_jobs_run_each_with_its_index_and_no_more_at_once_than_its_cap(stack: Stack) -> None:
    api = await stack.up()
    template = with_changes(sleeper("indexed"), name="indexed-{index}",
                            command="bash -c 'sleep 1; echo index=$TRAINYARD_ARRAY_INDEX seed={index}'")
    accepted = await api.submit_array(template, indices="0-4%2")
    ended = [await stack.wait_until(job_id, "ended", timeout=90) for job_id in accepted.job_ids]
    assert [job.status for job in ended] == ["succeeded"] * 5
    for index, job_id in zip(range(5), accepted.job_ids, strict=True):
        assert f"[0] index={index} seed={index}" in await stack.logs(job_id)
    # The cap held: at no moment were more than two of them running.
    spans = sorted((job.started_at, job.ended_at) for job in ended if job.started_at and job.ended_at)
    assert max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans) <= 2


async def test_the_past_is_told_as_it_was_and_replayed_as_it_ran(stack: Stack) -> None:
    """`trainyard at` and `trainyard simulate` on a real run: a job waits for another that holds both nodes."""
    api = await stack.up()
    before = datetime.now(UTC)
    await asyncio.sleep(0.1)
    first = await api.submit(with_changes(sleeper("first", nodes=2, seconds=3), flavors=["cpu-2"]))
    await stack.wait_until(first.job_id, "running", timeout=60)
    second = await api.submit(with_changes(sleeper("second", nodes=2, seconds=1), flavors=["cpu-2"]))
    ran = [await stack.wait_until(job.job_id, "ended", timeout=90) for job in (first, second)]
    assert [job.status for job in ran] == ["succeeded", "succeeded"]
    started = ran[1].started_at
    assert started is not None and ran[0].ended_at is not None and started >= ran[0].ended_at

    # At instants just before and just after the second started: queued behind the first, then running.
    api.at = started - timedelta(milliseconds=50)
    assert [job.job_id for job in await api.queue()] == [second.job_id]
    assert (await api.get_job(second.job_id)).job.status == "queued"
    assert (await api.why(second.job_id)).head
    api.at = started + timedelta(milliseconds=50)
    assert await api.queue() == []
    statuses = {job.job_id: job.status for job in await api.list_jobs()}
    assert statuses[second.job_id] == "running" and statuses[first.job_id] == "succeeded"
    api.at = None

    # Replayed with no change, each starts the instant the record lets it: the report's differences are exactly
    # the live scheduler's reaction times, however long this machine made them.
    # Its progress reaches the caller before the report: NATS lets the scheduler send more than one message to a
    # request's reply subject.
    told: list[SimulationProgress] = []
    report = await api.simulate(before, datetime.now(UTC), on_progress=told.append)
    assert told and told[0].stage == "rebuilding"
    assert (report.jobs, report.compared) == (2, 2)
    differences = start_differences(*ran)
    assert report.start_difference_p95 == pytest.approx(max(differences), abs=1e-6), (report, differences)
    assert report.start_difference_p50 == pytest.approx(statistics.median(differences), abs=1e-6)
    assert report.same_start == sum(difference < 1 for difference in differences)
