"""The workspace a job sees (SPEC L1, L5), through the real stack, on each workspace backend."""

from __future__ import annotations

import asyncio
import re

import pytest

from agent.isolation.workspace import BACKEND_VARIABLE, bwrap_problem
from agent.processes.signals import tagged_processes
from agent.ranks.kept import rank_root
from libs.contracts.events import NodeProcessStarted
from libs.contracts.jobspec import AlgorithmRef, DatasetRef, JobSpec, OutputRef
from tests.support.stack import Stack, process_alive

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

DATASET = "probe-data"
SKELETON = "algorithm anno_dataset dataset model outputs volume"


def probe(name: str, *, hold: float = 0.0) -> JobSpec:
    command = f"python3 look_around.py --dataset {DATASET} --hostfile /job/hostfile"
    if hold:
        command += f" --hold {hold} --ignore-term"
    return JobSpec(name=name, mode="pytorch-deepspeed", nodes=2, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="workspace-probe"), datasets=[DatasetRef(name=DATASET)],
                   output=OutputRef(name=name), command=command)


def seed_dataset(stack: Stack) -> None:
    dataset = stack.storage / "datasets" / DATASET
    dataset.mkdir(parents=True)
    (dataset / "hello.txt").write_text("hello from storage\n")


def require_bwrap() -> None:
    problem = bwrap_problem()
    if problem is not None:
        pytest.skip(f"bubblewrap cannot run jobs on this machine, so agents use the plain backend: {problem}")


async def backends(stack: Stack, job_id: str) -> dict[int, str]:
    events = await (await stack.api()).events(job_id)
    return {e.event.rank: e.event.backend for e in events if isinstance(e.event, NodeProcessStarted)}


async def test_a_bwrap_job_sees_the_real_workspace_paths(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    require_bwrap()
    monkeypatch.setenv(BACKEND_VARIABLE, "bwrap")  # the agents' setting, whatever the caller's
    seed_dataset(stack)
    api = await stack.up()
    accepted = await api.submit(probe("probe-bwrap"))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id)

    for rank in (0, 1):
        mine = [line.removeprefix(f"[{rank}] probe: ") for line in lines if line.startswith(f"[{rank}] probe: ")]
        assert mine[0] == "backend bwrap workspace /workspace cwd /workspace/algorithm"
        assert mine[1] == f"workspace holds {SKELETON}"
        assert mine[2] == "dataset reads hello from storage"
        # Read-only mounts are really read-only: EROFS (30) or EACCES (13).
        assert re.fullmatch(r"dataset write refused errno (30|13)", mine[3]), mine[3]
        assert mine[4] == "outputs write done"
        # L5: /job/hostfile itself, as the planner wrote it.
        assert mine[5:7] == ["hostfile node-a slots=1", "hostfile node-b slots=1"]
        assert mine[-1] == "done"
        assert (stack.storage / "outputs" / "probe-bwrap" / f"rank-{rank}.txt").read_text() == \
            f"written by rank {rank}\n"
    assert sorted(p.name for p in (stack.storage / "datasets" / DATASET).iterdir()) == ["hello.txt"]
    assert await backends(stack, accepted.job_id) == {0: "bwrap", 1: "bwrap"}


async def test_stopping_a_bwrap_job_leaves_no_process_behind(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    require_bwrap()
    monkeypatch.setenv(BACKEND_VARIABLE, "bwrap")
    seed_dataset(stack)
    api = await stack.up()
    accepted = await api.submit(probe("probe-stop", hold=300))
    running = await stack.wait_until(accepted.job_id, "running")

    # Each rank reports its own pid and the pid of a child it started, as its own process namespace numbers them.
    # Both ignore SIGTERM, so only the SIGKILL after the grace (TRAINYARD_STOP_GRACE_SECONDS) ends them.
    holding: dict[int, tuple[int, int]] = {}
    async with asyncio.timeout(120):
        while len(holding) < 2:
            for line in await stack.logs(accepted.job_id):
                if found := re.fullmatch(r"\[(\d)\] probe: holding pid (\d+) child (\d+)", line):
                    holding[int(found[1])] = (int(found[2]), int(found[3]))
            await asyncio.sleep(0.2)
    assert await backends(stack, accepted.job_id) == {0: "bwrap", 1: "bwrap"}
    # On the host: every process of the job (its variables name it), the probes and their children among them.
    on_host = tagged_processes(lambda env: env.get("TRAINYARD_JOB_ID") == accepted.job_id)
    assert len(on_host) >= 4
    assert all(holding[rank][0] < 10 for rank in holding)  # a namespace of its own: the job's few processes

    await api.stop([accepted.job_id])
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "stopped"
    pids = [i.pid for i in running.instances] + sorted(on_host)
    assert all(pid is not None for pid in pids)
    async with asyncio.timeout(60):  # reports may come before the last process is reaped
        while alive := [pid for pid in pids if pid is not None and process_alive(pid)]:
            await asyncio.sleep(0.2)
    assert alive == []


async def test_the_plain_backend_maps_the_same_tree(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_VARIABLE, "plain")
    seed_dataset(stack)
    api = await stack.up()
    accepted = await api.submit(probe("probe-plain"))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id)

    # TRAINYARD_WORKSPACE names the tree under the agent's folder; its algorithm is a link to storage.
    folder = rank_root(stack.home / "agents" / "node-a", accepted.job_id, 1, 0, 0)
    algorithm = (stack.storage / "algorithms" / "workspace-probe").resolve()
    assert f"[0] probe: backend plain workspace {folder}/workspace cwd {algorithm}" in lines
    assert f"[0] probe: workspace holds {SKELETON}" in lines
    assert "[1] probe: dataset reads hello from storage" in lines
    # The argv's /job/hostfile was rewritten to the file the agent wrote.
    assert [line for line in lines if line.startswith("[1] probe: hostfile ")] == \
        ["[1] probe: hostfile node-a slots=1", "[1] probe: hostfile node-b slots=1"]
    assert (stack.storage / "outputs" / "probe-plain" / "rank-1.txt").read_text() == "written by rank 1\n"
    assert await backends(stack, accepted.job_id) == {0: "plain", 1: "plain"}
