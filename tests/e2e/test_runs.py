"""A job's one run on the real stack (R1, R2): a worker killed mid-run does not finish it and the restarted
attempt continues it; the job's processes log on through an agent restart, each point stored once; a
series is followed while it is logged, and drawn."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client.api import TrainyardClient
from libs.contracts.jobspec import AlgorithmRef, FaultRestart, JobSpec, OutputRef
from libs.contracts.operations.runs import SeriesPoint
from tests.support.runs import finished_run
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]
REPO_ROOT = Path(__file__).resolve().parents[2]


def logger(name: str, *, nodes: int, steps: int, step_seconds: float, restarts: int = 0) -> JobSpec:
    return JobSpec(name=name, mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="metrics-logger"), output=OutputRef(name=name),
                   # Through a shell: a plain process per rank, not torch's launcher and the workers it starts
                   # in sessions of their own, so that killing a rank's process group kills its logging process.
                   command=f"bash -c \"exec python3 log.py --steps {steps} --step-seconds {step_seconds}\"",
                   fault_restart=FaultRestart(max_restarts=restarts) if restarts else None)


async def points(api: TrainyardClient, job_id: str, rank: int | None = 0) -> list[SeriesPoint]:
    return [point async for point in api.series(job_id, "loss", rank)]


async def wait_for_points(api: TrainyardClient, job_id: str, rank: int, count: int, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while len(await points(api, job_id, rank)) < count:
            await asyncio.sleep(0.3)


async def test_a_killed_worker_does_not_finish_the_run_and_the_restarted_attempt_continues_it(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(logger("worker-killed", nodes=2, steps=60, step_seconds=0.1, restarts=1))
    running = await stack.wait_until(accepted.job_id, "running")
    await wait_for_points(api, accepted.job_id, rank=1, count=5)
    worker = next(i for i in running.instances if i.rank == 1)
    assert worker.pid is not None
    os.killpg(worker.pid, signal.SIGKILL)  # rank 1's process group, mid-run

    async with asyncio.timeout(90):  # the restarted attempt logs into the same run, which goes on
        while (run := await api.run(accepted.job_id)).attempts != [1, 2]:
            await asyncio.sleep(0.3)
    assert run.state == "running"
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason

    run = await finished_run(api, accepted.job_id)
    assert (run.finished_by, run.attempts) == ("rank 0 ended", [1, 2])
    [killed] = [end for end in run.ended if end.attempt == 1 and end.rank == 1]
    assert killed.exit_code not in (0, None)
    # Rank 0's series holds both attempts: what attempt 1 logged before the kill, and all of attempt 2.
    rank_0 = await points(api, accepted.job_id)
    assert {p.attempt for p in rank_0} == {1, 2}
    assert [p.step for p in rank_0 if p.attempt == 2] == list(range(60))
    assert any(p.attempt == 1 for p in await points(api, accepted.job_id, rank=1))


@pytest.mark.slow_loss  # its agent must be back, or its heartbeats keep coming, however busy the machine
async def test_the_job_logs_on_through_an_agent_restart_and_a_follower_sees_every_point_once(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(logger("agent-restarts", nodes=1, steps=150, step_seconds=0.05))
    running = await stack.wait_until(accepted.job_id, "running")
    followed = asyncio.create_task(points_followed(api, accepted.job_id))
    await wait_for_points(api, accepted.job_id, rank=0, count=20)
    node = running.placement[0].node
    stack.crash(f"agent-{node}")  # kill -9, mid-run: the job logs on into its own buffer
    await asyncio.sleep(1.0)
    stack.start(f"agent-{node}")  # the next agent makes the run's socket again

    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    run = await finished_run(api, accepted.job_id)
    [loss] = [s for s in run.series if s.name == "loss"]
    assert (loss.count, loss.last_step) == (150, 149)
    assert [p.step for p in await points(api, accepted.job_id)] == list(range(150))  # none lost, none twice
    async with asyncio.timeout(120):
        assert [p.step for p in await followed] == list(range(150))
    assert any(s.name == "system/cpu_percent" for s in run.series)

    # The CLI draws the series in the terminal and to a PNG file, and tells the run's life.
    png = stack.home / "loss.png"
    drawn = await asyncio.to_thread(trainyard, stack, "metrics", accepted.job_id, "loss", "--plot", "--png", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert f"loss of {accepted.job_id}" in drawn.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    listed = await asyncio.to_thread(trainyard, stack, "metrics", accepted.job_id)
    assert listed.returncode == 0, listed.stderr
    assert "run: finished" in listed.stdout and "rank 0 ended" in listed.stdout


def trainyard(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NATS_URL": stack.nats_url, "COLUMNS": "120", "TRAINYARD_TOKEN": stack.token}
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=60, check=False)


async def points_followed(api: TrainyardClient, job_id: str) -> list[SeriesPoint]:
    """The series as `--follow` reads it: from the start, then what is logged, until the job ends."""
    return [point async for point in api.series(job_id, "loss", 0, follow=True, poll_seconds=0.3)]
