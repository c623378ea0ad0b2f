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

from agent.isolation.workspace import BACKEND_VARIABLE, PLAIN
from libs.contracts import subjects
from libs.contracts.codec import decode
from libs.contracts.events import NodeLaunch
from libs.contracts.runs import MetricBatch
from tests.support.agents import Node, registered_node
from tests.support.waiting import eventually

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
# Running on until the test saw the agent's sample of the rank (the file named first on the command line).
import os, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


@pytest_asyncio.fixture(loop_scope="session")
async def node(nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)
    async with registered_node(nc, nats_url, tmp_path, job_id=JOB, health_probe_seconds=60) as found:
        yield found


async def test_every_point_a_ranks_processes_log_reaches_jetstream_once_named_by_who_logged_it(
        node: Node, nc: Client, tmp_path: Path) -> None:
    batches: list[MetricBatch] = []
    sampled = tmp_path / "sampled"

    async def collect(msg: Msg) -> None:
        batches.append(decode(msg.data, MetricBatch))

    def names(process: str | None = None) -> list[str]:
        return [p.name for b in batches if process in (None, b.process) for p in b.points]

    async def seen_sampled() -> bool:
        return "system/cpu_percent" in names("system")

    async def all_arrived() -> bool:  # what the rank logged reaches the subject a moment after its exit is reported
        return (names().count("loss") >= 200 and "val_acc" in names("evaluator")
                and any("final_loss" in b.summary for b in batches))

    subscription = await nc.subscribe(subjects.job_metrics(JOB, node.name), cb=collect)
    try:
        running = asyncio.create_task(node.run(NodeLaunch(rank=0, node=node.name, address="127.0.0.1",
                                                          argv=[sys.executable, "-c", TRAINING, str(sampled)],
                                                          env={}, mounts=[])))
        await eventually(seen_sampled)
        sampled.touch()
        assert await running == 0
        await eventually(all_arrived)
    finally:
        sampled.touch()  # nothing is left waiting, whatever failed
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
