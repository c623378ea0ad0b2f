"""The autoscaler on the real stack with its EC2 provider against a real moto server (SPEC A1, A5): the boots
of its instances are played here, so each is a real node agent. A spot interruption under a running job is
found at the provider, the instance recorded gone, its node counted lost and the job resumed on a new
instance."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from client.api import TrainyardClient
from libs.contracts.cluster import (
    AutoscalerConfig,
    ClusterConfig,
    Ec2Settings,
    Flavor,
    InstanceNode,
    InstanceType,
)
from libs.contracts.events import AlertRaised, InstanceReleased, InstanceRequested, JobResuming
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef
from tests.support.ec2 import REGION, BootPlayer, an_image, moto_server
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

CLUSTER_TAG = "e2e-spot"


def spot_cluster(moto_url: str) -> ClusterConfig:
    spot = InstanceType(
        name="spot", provider="aws-ec2", flavors=["cpu-1"], max_instances=3, idle_seconds=60,
        node=InstanceNode(cpus=1, memory_mib=2048, pools=["spot"]), cpu_only=True,
        aws=Ec2Settings(image_id=an_image(moto_url), instance_type="t3.small", region=REGION, endpoint_url=moto_url,
                        spot=True))
    # Reconciled every second, an instance missing from the provider's list counts at once: the drill
    # plays out in seconds rather than the minute a deployment waits.
    return ClusterConfig(flavors=[Flavor(name="cpu-1", cpus=1, memory_mib=1024)], autoscaler=AutoscalerConfig(
        max_instances=3, cluster=CLUSTER_TAG, boot_timeout_seconds=120, reconcile_seconds=1.0,
        listing_grace_seconds=0.0, instance_types=[spot]))


@pytest_asyncio.fixture(loop_scope="session")
async def spot_stack(tmp_path: Path, database_url: str) -> AsyncIterator[tuple[Stack, BootPlayer]]:
    tmp_path.chmod(0o755)
    with moto_server() as moto_url:
        cluster = tmp_path / "cluster.yaml"
        cluster.write_bytes(msgspec.yaml.encode(spot_cluster(moto_url)))
        stack = Stack(tmp_path / "stack", None, database_url, connect=TrainyardClient.open, cluster=cluster)
        # The machines get what the stack's own processes get (less the control plane's secrets).
        player = BootPlayer(moto_url, CLUSTER_TAG, tmp_path / "machines", {**os.environ, **stack.processes.env})
        player.start()
        try:
            yield stack, player
        finally:
            await stack.close()
            await player.close()
            print(stack.dump_logs())  # shown by pytest only when the test failed


async def test_a_spot_interruption_under_a_running_job_resumes_it_on_a_new_instance(
        spot_stack: tuple[Stack, BootPlayer]) -> None:
    stack, player = spot_stack
    stack.start_all()
    api = await stack.api()
    spec = JobSpec(name="spot", mode="pytorch", nodes=1, flavors=["cpu-1"], pool="spot",
                   algorithm=AlgorithmRef(name="pytorch-resumable"), output=OutputRef(name="spot"),
                   command="python3 train.py --steps 40 --step-seconds 0.2",
                   checkpoint_resume=CheckpointResume(max_resumes=2, graceful_shutdown_seconds=5))
    job = await api.submit(spec)
    running = await stack.wait_until(job.job_id, "running", timeout=120)
    [first] = {p.node for p in running.placement}
    async with asyncio.timeout(60):
        while not any("rank 0 step 3 " in line for line in await stack.logs(job.job_id)):
            await asyncio.sleep(0.3)

    interrupted = await player.interrupt(first)

    ended = await stack.wait_until(job.job_id, "ended", timeout=240)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 1
    [second] = {p.node for p in ended.placement}
    assert second != first and player.machine(second).instance_id != interrupted
    lines = await stack.logs(job.job_id)
    assert "[0] rank 0/1 on " + second + " joined (resume 1)" in lines
    assert "[0] rank 0 finished at step 40" in lines
    # The autoscaler found the instance gone at the provider, and asked for one more for the job.
    story = [e.event async for e in api.autoscaler_log()]
    gone = [e for e in story if isinstance(e, InstanceReleased) and e.instance == first]
    assert [e.cause for e in gone] == ["gone"]
    asked = [e for e in story if isinstance(e, InstanceRequested)]
    assert [(e.instance, e.jobs) for e in asked] == [(first, [job.job_id]), (second, [job.job_id])]
    # The monitor counted its node lost (a job ran there): the job resumed for that reason.
    reasons = [e.event.reason for e in await api.history(job.job_id) if isinstance(e.event, JobResuming)]
    assert reasons and f"node {first} was lost" in reasons[0]
    kinds = {(e.event.kind, e.event.node) async for e in api.alerts() if isinstance(e.event, AlertRaised)}
    assert ("node-lost", first) in kinds
    # Its node, lost with a job on it, is then retired: the machine is gone for good.
    async with asyncio.timeout(30):
        while first in {n.info.name for n in await api.nodes()}:
            await asyncio.sleep(0.3)
