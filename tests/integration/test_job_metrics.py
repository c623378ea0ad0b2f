"""A job's processes log metrics with `trainyard.run` (SPEC R1): through their node's agent, every point
reaches JetStream once, named by the job, attempt, rank and process, from the rank and from a process it
started. Against a real agent on real NATS."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.workspace import BACKEND_VARIABLE, PLAIN
from libs.contracts import subjects
from libs.contracts.codec import decode
from libs.contracts.events import NodeLaunch
from libs.contracts.runs import MetricBatch
from tests.support.agents import Node, registered_node

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-5e5510aa0016"
TRAINING = """
import subprocess, sys
from trainyard import run
run.config({"lr": 0.01})
for step in range(200):
    run.log({"loss": 1.0 / (step + 1)}, step=step)
# A helper process of the rank logs into the same run, under a label of its own.
subprocess.run([sys.executable, "-c", "from trainyard import run; run.log({'val_acc': 0.75}, step=199)"],
               env={**__import__("os").environ, "TRAINYARD_RUN_PROCESS": "evaluator"}, check=True)
run.summary({"final_loss": 1.0 / 200})
__import__("time").sleep(1.0)  # long enough for the agent to sample the rank
"""


@pytest_asyncio.fixture(loop_scope="session")
async def node(nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)
    async with registered_node(nc, nats_url, tmp_path, job_id=JOB, health_probe_seconds=60) as found:
        yield found


async def test_every_point_a_ranks_processes_log_reaches_jetstream_once_named_by_who_logged_it(
        node: Node, nc: Client) -> None:
    batches: list[MetricBatch] = []

    async def collect(msg: Msg) -> None:
        batches.append(decode(msg.data, MetricBatch))

    subscription = await nc.subscribe(subjects.job_metrics(JOB, node.name), cb=collect)
    try:
        code = await node.run(NodeLaunch(rank=0, node=node.name, address="127.0.0.1",
                                         argv=[sys.executable, "-c", TRAINING], env={}, mounts=[]))
        assert code == 0
        await asyncio.sleep(0.5)
    finally:
        await subscription.unsubscribe()
    points = [(b.process, p.name, p.step, p.value) for b in batches for p in b.points]
    losses = [step for process, name, step, _ in points if name == "loss"]
    assert losses == list(range(200))  # each once, in order
    assert [(process, name) for process, name, _, _ in points if name != "loss" and process != "system"] == [
        ("evaluator", "val_acc")]
    # The agent's samples of the rank are its system series, under a label of their own.
    assert {name for process, name, _, _ in points if process == "system"} >= {"system/cpu_percent",
                                                                               "system/memory_mib"}
    [trainer] = {process for process, name, _, _ in points if name == "loss"}
    assert trainer.startswith("pid-")  # a process not labelled is named by its pid
    assert all((b.job_id, b.attempt, b.rank, b.node) == (JOB, 1, 0, node.name) for b in batches)
    assert {k: v for b in batches for k, v in b.config.items()} == {"lr": 0.01}
    assert {k: v for b in batches for k, v in b.summary.items()} == {"final_loss": 0.005}
