"""Agents on separate hosts: each node agent in a network namespace of its own, with its own address on a bridge,
NATS and the services on the control host (devstack/hosts.py). Nothing crosses hosts through 127.0.0.1.

Skipped, saying why, where network namespaces cannot be made (not root, no iproute2, a sandbox that forbids them).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from client.api import TrainyardClient
from devstack.harness import CLUSTER, FAST_TIMINGS
from devstack.hosts import unavailable
from devstack.stack import REPO_ROOT
from libs.contracts.jobspec import decode_spec
from tests.support.specs import mpi_hello, resumable, sleeper
from tests.support.stack import Stack

WHY_NOT = unavailable()
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"separate hosts cannot be made here: {WHY_NOT}")]
HERE = Path(__file__).parent
RESILIENT = HERE / "cluster-resilient.yaml"


@pytest_asyncio.fixture(loop_scope="session")
async def hosts(tmp_path: Path, database_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """The stack with every agent on a host of its own, on the cluster config of `@pytest.mark.cluster(path)` if
    given; a test marked `slow_loss` has nodes counted lost after 10 s of silence rather than 3."""
    tmp_path.chmod(0o755)
    marker = request.node.get_closest_marker("cluster")
    timings = {**FAST_TIMINGS, "TRAINYARD_NODE_LOST_SECONDS": "10"} if request.node.get_closest_marker(
        "slow_loss") else None
    stack = Stack(tmp_path, None, database_url, connect=TrainyardClient.open, cluster=marker.args[0] if marker
                  else CLUSTER, algorithms=HERE / "algorithms", timings=timings, separate_hosts=True)
    try:
        yield stack
    finally:
        await stack.close()
        print(stack.dump_logs())


async def test_a_two_node_pytorch_job_trains_across_two_hosts(hosts: Stack) -> None:
    api = await hosts.up()
    assert hosts.hosts is not None
    spec = decode_spec((REPO_ROOT / "examples" / "pytorch-ddp.yaml").read_bytes(), yaml=True)
    command = spec.command.replace("--steps 40", "--steps 20") if spec.command else None
    accepted = await api.submit(msgspec.structs.replace(spec, command=command))
    job = await hosts.wait_until(accepted.job_id, "ended", timeout=180)
    assert job.status == "succeeded", job.reason
    # Each rank on its own host, reached at that host's address.
    assert {(p.node, p.address) for p in job.placement} == {
        ("node-a", hosts.hosts.address("node-a")), ("node-b", hosts.hosts.address("node-b"))}
    assert hosts.nats_url.startswith(f"nats://{hosts.hosts.control}:")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI (Debian: openmpi-bin) is not installed")
async def test_horovods_mpirun_reaches_the_other_host_through_its_agent(hosts: Stack) -> None:
    api = await hosts.up()
    accepted = await api.submit(mpi_hello())
    job = await hosts.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    lines = await hosts.logs(accepted.job_id, 0)
    assert "[0] hello from rank 0 of 2 on node-a" in lines
    assert "[0] hello from rank 1 of 2 on node-b" in lines


@pytest.mark.cluster(RESILIENT)
async def test_a_checkpoint_job_moves_to_a_third_host_when_its_hosts_link_is_cut(hosts: Stack) -> None:
    api = await hosts.up()
    assert hosts.hosts is not None
    accepted = await api.submit(resumable("cut"))
    running = await hosts.wait_until(accepted.job_id, "running", timeout=120)
    cut = running.placement[1].node
    await asyncio.sleep(3)  # some steps done, a checkpoint worth keeping
    hosts.hosts.cut(cut)  # the cable pulled: its agent, and the rank there, are cut off
    try:
        ended = await hosts.wait_until(accepted.job_id, "ended", timeout=300)
    finally:
        hosts.hosts.mend(cut)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 1
    assert cut not in {p.node for p in ended.placement}
    assert {p.node for p in ended.placement} == {"node-a", "node-b", "node-c"} - {cut}


@pytest.mark.slow_loss
async def test_an_agent_cut_off_for_five_seconds_keeps_its_job(hosts: Stack) -> None:
    api = await hosts.up()
    assert hosts.hosts is not None
    accepted = await api.submit(msgspec.structs.replace(sleeper("through", seconds=15), flavors=["cpu-1"]))
    running = await hosts.wait_until(accepted.job_id, "running", timeout=60)
    node = running.placement[0].node
    hosts.hosts.cut(node)
    await asyncio.sleep(5)
    hosts.hosts.mend(node)
    job = await hosts.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason  # a node counted lost would have failed it
    assert job.attempt == 1 and [p.node for p in job.placement] == [node]  # its first attempt, where it began
    assert {n.info.name: n.status for n in await api.nodes()}[node] == "ready"
