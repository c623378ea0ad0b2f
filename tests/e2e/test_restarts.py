"""Crash a service with kill -9 at the worst moment: no job is lost and none runs twice."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client.api import TrainyardClient
from libs.contracts.events import JobAdmitted, LaunchPlanned, NodeProcessStarted
from libs.messaging.rpc import ServiceUnavailable
from tests.support.specs import sleeper
from tests.support.stack import Stack, process_alive

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]


async def autoscaler_sees_queued(api: TrainyardClient, by_flavor: dict[str, int]) -> None:
    """Wait until the autoscaler (which follows the scheduler's events) counts these queued jobs."""
    async with asyncio.timeout(90):
        while True:
            with contextlib.suppress(ServiceUnavailable):
                if (await api.queue_status()).queued_by_flavor == by_flavor:
                    return
            await asyncio.sleep(0.2)


async def test_scheduler_killed_between_submit_and_admission_admits_the_job_once(stack: Stack) -> None:
    # No agents yet: the job is accepted and stays queued.
    stack.start_all(agents=False)
    api = await stack.api()
    await stack.wait_for_nodes(count=0)
    accepted = await api.submit(sleeper("survivor", nodes=2, seconds=0.5))
    assert (await api.get_job(accepted.job_id)).job.status == "queued"
    await autoscaler_sees_queued(api, {"cpu-1": 1})

    stack.crash("scheduler")
    stack.crash("autoscaler")
    stack.start("scheduler")
    stack.start("autoscaler")
    # The autoscaler rebuilt its view of demand from the log.
    await autoscaler_sees_queued(api, {"cpu-1": 1})
    stack.start("agent-node-a")
    stack.start("agent-node-b")

    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    history = await api.events(accepted.job_id)
    assert sum(isinstance(e.event, JobAdmitted) for e in history) == 1
    assert sum(isinstance(e.event, LaunchPlanned) for e in history) == 1


async def test_launcher_killed_while_a_job_runs_neither_relaunches_nor_forgets_it(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(sleeper("keeps-running", nodes=2, seconds=6))
    await stack.wait_until(accepted.job_id, "running")

    stack.crash("launcher")
    await asyncio.sleep(1.0)
    stack.start("launcher")

    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id)
    # Each rank's script started exactly once.
    assert sum("started rank" in line for line in lines) == 2
    history = await api.events(accepted.job_id)
    assert sum(isinstance(e.event, LaunchPlanned) for e in history) == 1
    assert sorted(e.event.rank for e in history if isinstance(e.event, NodeProcessStarted)) == [0, 1]


@pytest.mark.slow_loss  # its agent must be back, or its heartbeats keep coming, however busy the machine
async def test_a_job_outlives_its_killed_agent_and_the_restarted_agent_adopts_it(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(sleeper("outlives-its-agent", nodes=2, seconds=6))
    running = await stack.wait_until(accepted.job_id, "running")
    pid = next(i.pid for i in running.instances if i.node == "node-b")

    stack.crash("agent-node-b")  # kill -9: no agent code runs
    await asyncio.sleep(1)
    assert pid is not None and process_alive(pid)  # the job's process is not the agent's to take along
    stack.start("agent-node-b")  # back before the monitor would call the node lost

    job = await stack.wait_until(accepted.job_id, "ended", timeout=60)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id, 1)
    assert [line.split(" pid ")[0] for line in lines] == ["[1] started rank 1 on node-b", "[1] done rank 1"]
    history = await api.events(accepted.job_id)
    assert sorted(e.event.rank for e in history if isinstance(e.event, NodeProcessStarted)) == [0, 1]


async def test_standbys_take_over_from_a_killed_scheduler_and_launcher_and_no_job_is_lost_or_run_twice(
        stack: Stack) -> None:
    api = await stack.up()  # the first processes hold the leases
    stack.start_standby("scheduler")
    stack.start_standby("launcher")
    running = await api.submit(sleeper("runs-on", nodes=2, seconds=8))
    await stack.wait_until(running.job_id, "running")

    stack.crash("scheduler")
    stack.crash("launcher")
    # Answered once the standby scheduler took over (the client sends it again, with the same job id).
    submitted = await api.submit(sleeper("submitted-meanwhile", nodes=1, seconds=0.5))

    for accepted, ranks in ((running, 2), (submitted, 1)):
        job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
        assert job.status == "succeeded", job.reason
        assert sum("started rank" in line for line in await stack.logs(accepted.job_id)) == ranks
        history = await api.events(accepted.job_id)
        assert sum(isinstance(e.event, JobAdmitted) for e in history) == 1
        assert sum(isinstance(e.event, LaunchPlanned) for e in history) == 1
    assert len([j for j in await api.list_jobs() if j.name == "submitted-meanwhile"]) == 1
