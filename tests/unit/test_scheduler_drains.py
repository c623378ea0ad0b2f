"""The scheduler's side of releasing an idle instance (SPEC A3): a draining node takes no job, the scheduler
says so in its own log once, a kept one takes jobs again, and a retired one is gone."""

from __future__ import annotations

from libs.contracts.events import InstanceDraining, InstanceKept, JobAdmitted, NodeDrained, NodeRetired
from tests.support.platform import JOB, Platform, plain_spec


async def test_a_draining_node_takes_no_job_and_the_scheduler_acknowledges_the_drain_once() -> None:
    platform = Platform()
    await platform.node("small-1")
    draining = InstanceDraining(instance="small-1", node="small-1", idle_since=platform.log.now)
    await platform.autoscaler(draining)
    await platform.submit(JOB, plain_spec())
    await platform.cycle()
    assert not isinstance(platform.last(JOB), JobAdmitted)
    assert platform.log.of("scheduler", "small-1") == [NodeDrained(node_name="small-1", instance="small-1")]
    assert platform.replayed().nodes["small-1"].status == "draining"

    await platform.autoscaler(InstanceKept(instance="small-1", node="small-1", reason="a job holds it"))
    await platform.cycle()
    assert isinstance(platform.last(JOB), JobAdmitted)


async def test_a_retired_node_is_gone_from_the_scheduler() -> None:
    platform = Platform()
    await platform.node("small-1")
    await platform.node_event(NodeRetired(node_name="small-1", reason="released by the autoscaler: idle for 60s"))
    assert "small-1" not in platform.state.nodes
