"""`trainyard tensorboard` on the whole stack (R2, O5): a batch job's tasks log their loss with
`trainyard.run`, and one TensorBoard, served by the CLI, shows each task as a run of its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import urllib.request
from asyncio.subprocess import PIPE, Process
from typing import Any

import pytest

from devstack.stack import REPO_ROOT
from libs.contracts.jobspec import AlgorithmRef, BatchTask, JobSpec, OutputRef
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

RUNS = ["task-0/rank-0", "task-1/rank-0", "task-2/rank-0"]


def logs_loss(scale: int) -> str:
    """A task that logs loss = scale / step for steps 1 to 10 (its own numbers, to tell the tasks apart)."""
    return (f"python3 -c \"from trainyard import run; "
            f"[run.log({{'loss': {scale} / step}}, step=step) for step in range(1, 11)]\"")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return json.loads(reply.read())


async def announced(cli: Process, timeout: float = 120) -> list[str]:
    """The command's lines up to the one giving TensorBoard's URL: it serves from then on."""
    assert cli.stdout is not None and cli.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(timeout):
        while not lines or not lines[-1].startswith("TensorBoard: "):
            line = (await cli.stdout.readline()).decode()
            if not line:
                errors = (await cli.stderr.read()).decode()
                pytest.fail(f"trainyard tensorboard ended before serving:\n{''.join(lines)}\n{errors}")
            lines.append(line)
    return lines


async def listed_runs(url: str, cli: Process, count: int, timeout: float = 120) -> list[str]:
    """TensorBoard's runs once it lists `count` of them; fails if the command ends first."""
    async with asyncio.timeout(timeout):
        while True:
            if cli.returncode is not None:
                out, err = await cli.communicate()
                pytest.fail(f"trainyard tensorboard ended with code {cli.returncode}:\n{out.decode()}\n{err.decode()}")
            try:
                runs: list[str] = await asyncio.to_thread(get_json, f"{url}data/runs")
            except OSError:
                runs = []
            if len(runs) >= count:
                return runs
            await asyncio.sleep(0.5)


async def test_tensorboard_shows_each_task_of_a_batch_job_as_a_run(stack: Stack) -> None:
    api = await stack.up()
    tasks = [BatchTask(algorithm=AlgorithmRef(name="sleeper"), command=logs_loss(scale)) for scale in (1, 2, 3)]
    spec = JobSpec(name="tb-sweep", type="batch", mode="single-node", nodes=1, flavors=["cpu-1"], tasks=tasks,
                   output=OutputRef(name="tb-sweep"))
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "NATS_URL": stack.nats_url, "COLUMNS": "200", "TRAINYARD_TOKEN": stack.token}
    cli = await asyncio.create_subprocess_exec(sys.executable, "-m", "client.cli", "tensorboard", accepted.job_id,
                                               "--port", str(port), stdout=PIPE, stderr=PIPE, env=env, cwd=REPO_ROOT)
    try:
        printed = await announced(cli)
        assert printed[-1] == f"TensorBoard: {url} (Ctrl-C stops it)\n"
        assert sorted(await listed_runs(url, cli, len(RUNS))) == RUNS
        values = await asyncio.to_thread(get_json, f"{url}data/plugin/scalars/scalars?run=task-1/rank-0&tag=loss")
        assert [step for _, step, _ in values] == list(range(1, 11))
        assert [value for _, _, value in values] == pytest.approx([2 / step for step in range(1, 11)])

        cli.send_signal(signal.SIGINT)  # Ctrl-C
        async with asyncio.timeout(120):
            output, errors = await cli.communicate()
    finally:
        if cli.returncode is None:
            cli.kill()
            await cli.wait()
    assert cli.returncode == 0, errors.decode()
    assert all(any(line.startswith(f" {run}  loss ") for line in printed) for run in RUNS)  # what it wrote
    assert output.decode() == "stopped TensorBoard\n"
    with pytest.raises(OSError):  # TensorBoard ended with the command
        get_json(f"{url}data/runs")
