"""The autoscaler on the real stack with its local provider (SPEC A1, A4, A5): a pool without a node grows
instances for the jobs that wait, each a real node agent that registers with its own node credential."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from libs.contracts.autoscaling import INSTANCE_LABEL
from libs.contracts.events import AlertRaised, InstanceReleased, InstanceRequested, JobAdmitted, ProvisionFailed
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.operations.autoscaler import QueueStatus
from libs.messaging.rpc import ServiceUnavailable
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

AUTOSCALED = Path(__file__).parent / "cluster-autoscaled.yaml"
BROKEN = Path(__file__).parent / "cluster-autoscaled-broken.yaml"
BURST = Path(__file__).parent / "cluster-autoscaled-burst.yaml"


async def instances_until(stack: Stack, done: Callable[[QueueStatus], bool], timeout: float = 90) -> QueueStatus:
    """The autoscaler's status once `done` holds (asked again while a restarted autoscaler starts)."""
    api = await stack.api()
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(ServiceUnavailable):
                status = await api.queue_status()
                if done(status):
                    return status
            await asyncio.sleep(0.3)


@pytest.mark.slow_loss  # its agent must be back, or its heartbeats keep coming, however busy the machine
@pytest.mark.cluster(AUTOSCALED)
async def test_a_gang_job_on_an_empty_pool_gets_two_instances_and_runs_on_them(stack: Stack) -> None:
    api = await stack.up()
    assert await api.nodes() == []
    spec = JobSpec(name="grown", mode="pytorch", nodes=2, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"),
                   command="bash -c 'echo rank $RANK of $WORLD_SIZE; echo cuda=$CUDA_VISIBLE_DEVICES'",
                   output=OutputRef(name="grown"))
    accepted = await api.submit(spec)

    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    status = await api.queue_status()
    assert [(i.instance_type, i.jobs) for i in status.instances] == [("small", [accepted.job_id])] * 2
    names = {i.name for i in status.instances}
    assert {p.node for p in job.placement} == names  # the job ran on the two instances, one rank each
    nodes = {node.info.name: node.info for node in await api.nodes()}
    assert set(nodes) == names
    assert all(nodes[name].labels[INSTANCE_LABEL] == name and nodes[name].labels["size"] == "small"
               for name in names)
    lines = await stack.logs(accepted.job_id)
    assert "[0] cuda=none" in lines and "[1] cuda=none" in lines  # a CPU-only type (A4)
    for name in names:  # the type's init script ran on each before its agent started
        assert (stack.home / "instances" / name / "prepared").read_text() == "prepared by the init script\n"

    # Idle for the type's 5 s, they are drained, then released; their nodes retire without a lost-node alert.
    await instances_until(stack, lambda status: not status.instances)
    async with asyncio.timeout(90):
        while await api.nodes():
            await asyncio.sleep(0.3)
    assert not (stack.home / "instances").exists() or not any((stack.home / "instances").iterdir())
    kinds = [envelope.event.kind async for envelope in api.alerts() if isinstance(envelope.event, AlertRaised)]
    assert "node-lost" not in kinds
    # The autoscaler's own log tells the whole story of both instances (A6).
    story = [type(envelope.event).name() async for envelope in api.autoscaler_log()]
    assert sorted(set(story)) == sorted({"InstanceRequested", "InstanceLaunched", "InstanceReady", "InstanceDraining",
                                         "InstanceReleased"})
    assert all(story.count(name) == 2 for name in set(story))


@pytest.mark.cluster(AUTOSCALED)
async def test_an_autoscaler_killed_while_its_instances_boot_starts_none_twice(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="grown", mode="pytorch", nodes=2, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"),
                   command="bash -c 'echo rank $RANK'", output=OutputRef(name="grown"))
    accepted = await api.submit(spec)
    booting = await instances_until(stack, lambda status: len(status.instances) == 2)
    stack.crash("autoscaler")  # kill -9, the instances asked for and maybe being started
    await asyncio.sleep(0.5)
    stack.start("autoscaler")

    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    status = await instances_until(stack, lambda status: True)  # the restarted autoscaler answers
    assert {i.name for i in status.instances} == {i.name for i in booting.instances}
    assert sorted(p.name for p in (stack.home / "instances").iterdir()) == sorted(i.name for i in booting.instances)
    assert len(await api.nodes()) == 2


@pytest.mark.cluster(BROKEN)
async def test_a_type_that_cannot_boot_cools_down_and_why_tells_the_waiting_job(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="waits", flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command="true",
                   output=OutputRef(name="waits"))
    accepted = await api.submit(spec)
    status = await instances_until(stack, lambda status: bool(status.cooldowns))
    assert [c.instance_type for c in status.cooldowns] == ["broken"] and status.instances == []
    report = await api.why(accepted.job_id)
    assert any("could not be started: the init script exited with code 4" in line and "No broken is asked for before"
               in line for line in report.summary), report.summary
    failures = [e.event async for e in api.autoscaler_log() if isinstance(e.event, ProvisionFailed)]
    assert len(failures) == 1  # one try, then the type waits: no instance is started again and again


@pytest.mark.cluster(BURST)
async def test_a_burst_of_fifty_jobs_gets_the_instances_a_placement_needs_and_no_more(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="burst", flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command="sleep 2",
                   output=OutputRef(name="burst"))
    accepted = await asyncio.gather(*(api.submit(spec) for _ in range(50)))
    for job in accepted:
        assert (await stack.wait_until(job.job_id, "ended", timeout=180)).status == "succeeded"
    requested = [e.event async for e in api.autoscaler_log() if isinstance(e.event, InstanceRequested)]
    assert len(requested) == 7  # 50 single-CPU jobs on 8-CPU instances; ClearML would count 50 tasks
    # Each was asked for the jobs that waited when it was; jobs that came later took room on those coming.
    assert {j for r in requested for j in r.jobs} <= {a.job_id for a in accepted}


@pytest.mark.cluster(AUTOSCALED)
async def test_jobs_submitted_while_idle_instances_are_released_never_land_on_a_released_one(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="racer", flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command="true",
                   output=OutputRef(name="racer"))
    first = await api.submit(spec)
    assert (await stack.wait_until(first.job_id, "ended", timeout=120)).status == "succeeded"
    # The instance idles 5 s, then is drained and released: submit jobs all around that moment.
    await asyncio.sleep(4.0)
    racers = []
    for _ in range(15):
        racers.append(await api.submit(spec))
        await asyncio.sleep(0.25)
    released: dict[str, datetime] = {}
    for racer in racers:
        job = await stack.wait_until(racer.job_id, "ended", timeout=120)
        assert job.status == "succeeded", job.reason  # none was placed on an instance being ended
    async for envelope in api.autoscaler_log():
        if isinstance(envelope.event, InstanceReleased):
            released[envelope.event.instance] = envelope.recorded_at
    for racer in racers:
        admitted = [e for e in await api.events(racer.job_id) if isinstance(e.event, JobAdmitted)]
        for envelope in admitted:
            assert isinstance(envelope.event, JobAdmitted)
            for place in envelope.event.placement:
                assert place.node not in released or envelope.recorded_at < released[place.node]
