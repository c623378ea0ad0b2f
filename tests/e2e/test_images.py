"""Jobs that run inside their image (SPEC J10), through the real stack: a real image built without a registry
(tests/support/testimage.py), registered, and a two-node job whose probe reports what it sees in there."""

from __future__ import annotations

import re

import msgspec
import pytest

from agent.isolation.workspace import BACKEND_VARIABLE, bwrap_problem
from agent.processes.jobenv import DEFAULT_PATH
from libs.contracts.events import NodeProcessStarted
from libs.contracts.jobspec import AlgorithmRef, DatasetRef, DebugTerminal, JobSpec, LifecycleScripts, OutputRef
from tests.support.stack import Stack
from tests.support.testimage import MARK_TEXT, test_image, test_image_problem
from tests.support.waiting import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

DATASET = "probe-data"
IMAGE = "trainyard/test:1"
MARK = MARK_TEXT.strip()  # what the image's /etc/trainyard-test-image says


def probe(name: str, **changes: object) -> JobSpec:
    spec = JobSpec(name=name, mode="pytorch-deepspeed", nodes=2, flavors=["cpu-1"], image=IMAGE,
                   algorithm=AlgorithmRef(name="image-probe"), datasets=[DatasetRef(name=DATASET)],
                   output=OutputRef(name=name), command=f"python3 look_inside.py {DATASET}",
                   lifecycle=LifecycleScripts(before_start="cat /etc/trainyard-test-image"))
    return msgspec.structs.replace(spec, **changes)


@pytest.fixture
def image_stack(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Stack:
    for problem in (bwrap_problem(), test_image_problem()):
        if problem is not None:
            pytest.skip(f"jobs in images cannot run here: {problem}")
    monkeypatch.setenv(BACKEND_VARIABLE, "bwrap")  # the agents' setting, whatever the caller's
    dataset = stack.storage / "datasets" / DATASET
    dataset.mkdir(parents=True)
    (dataset / "hello.txt").write_text("hello from storage\n")
    return stack


async def started(stack: Stack, job_id: str) -> list[NodeProcessStarted]:
    events = await (await stack.api()).events(job_id)
    return sorted((e.event for e in events if isinstance(e.event, NodeProcessStarted)), key=lambda e: e.rank)


async def test_a_two_node_job_runs_inside_its_image(image_stack: Stack) -> None:
    stack = image_stack
    api = await stack.up()
    image = await api.register_image(IMAGE, test_image().oci_archive, boards=["cpu"], description="bookworm")
    accepted = await api.submit(probe("in-image"))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=240)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id)
    for rank in (0, 1):
        mine = [line.removeprefix(f"[{rank}] probe: ") for line in lines if line.startswith(f"[{rank}] probe: ")]
        assert mine[0] == f"variant trainyard-test-image marker {MARK}"
        assert mine[1] == "python /usr/bin/python3 image var from-image"  # the image's python and environment
        assert mine[2] == "host files visible False"
        assert mine[3] == "cwd /workspace/algorithm"
        assert mine[4] == f"mode RANK={rank} WORLD_SIZE=2 MASTER_PORT set True"
        assert mine[5] == "dataset reads hello from storage"
        assert re.fullmatch(r"dataset write refused errno (30|13)", mine[6]), mine[6]
        assert mine[7:9] == ["hostfile node-a slots=1", "hostfile node-b slots=1"]
        assert (stack.storage / "outputs" / "in-image" / f"rank-{rank}.txt").read_text() == \
            f"written in the image by rank {rank}\n"
        # The lifecycle script ran in the image too.
        assert f"[{rank}] {MARK}" in lines
    first = await started(stack, accepted.job_id)
    assert [(e.backend, e.image, e.image_unpacked) for e in first] == [("bwrap", f"{IMAGE}@{image.digest}", True)] * 2

    again = await api.submit(probe("in-image-again"))
    assert (await stack.wait_until(again.job_id, "ended", timeout=120)).status == "succeeded"
    assert [e.image_unpacked for e in await started(stack, again.job_id)] == [False, False]  # the nodes' caches

    async def images_listed() -> list[tuple[str, str, str, list[str]]] | None:
        found = [(node.node, i.ref, i.digest, i.pins) for node in await api.cache() for i in node.images]
        return found if len(found) == 2 and not any(pins for *_, pins in found) else None

    # Each node's cache report lists the image it keeps unpacked, unpinned once the jobs ended (`trainyard cache`).
    assert await eventually(images_listed) == [(node, IMAGE, image.digest, []) for node in ("node-a", "node-b")]


async def test_a_kept_failed_job_is_debugged_inside_its_image(image_stack: Stack) -> None:
    stack = image_stack
    api = await stack.up()
    await api.register_image(IMAGE, test_image().rootfs_tar, boards=["cpu"])
    accepted = await api.submit(probe("failing", nodes=1, mode="single-node", env={"PROBE_EXIT": "3"},
                                      debug_terminal=DebugTerminal(enabled=True), lifecycle=None))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=240)
    assert job.status == "failed"
    code, output = await api.run_in_job(accepted.job_id, "cat /etc/trainyard-test-image; ls /workspace/outputs; "
                                        'echo "$PATH"', timeout=60)
    # In the image, with its files, the job's workspace and the image's PATH (not the agent's interpreter first).
    assert (code, output.decode().splitlines()) == (0, [MARK, "rank-0.txt", DEFAULT_PATH])
