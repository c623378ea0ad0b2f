"""A node agent runs for months while a million jobs pass through it: once a rank ended and was reported, its
runner keeps nothing of it (its environment, its token) but a note that it ended, and forgets that note and
those of stopped attempts after FORGET_SECONDS. Until then a start sent again (redelivered, or sent anew by a
restarted launcher) is answered `already_known` and runs nothing, as before.

The runner is driven directly, its commands run by a real holder; what it would publish is collected here,
and its clock is one the tests move.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_asyncio
from nats.aio.client import Client

from agent.caches.datacache import DatasetCache
from agent.caches.imageprep import ImagePreparation
from agent.caches.preparation import DataPreparation
from agent.isolation.workspace import PLAIN
from agent.output.shipper import OutputShipper
from agent.ranks.debugging import DebugSessions
from agent.ranks.runner import FORGET_SECONDS, RankRunner
from agent.ranks.running_rank import RankKey, RunningNode
from agent.ranks.tcp_ports import PortBook
from libs.contracts import subjects
from libs.contracts.agent import ProcessAccepted, ProcessExited, ProcessReport, StartProcess, StopProcesses
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode_any
from libs.contracts.events import Mount, NodeLaunch

pytestmark = pytest.mark.asyncio(loop_scope="session")

NODE = "node-forgets"
WAIT_SECONDS = 30
TRUE = shutil.which("true") or "/bin/true"
RANKS = 40


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Offline:
    """The agent's NATS connection, as far as a runner whose publishing is collected needs one."""

    is_closed = False

    def jetstream(self) -> None:
        return None


class CollectedOutput(OutputShipper):
    """The agent's shipper, keeping what it would publish."""

    def __init__(self, info: NodeInfo) -> None:
        super().__init__(cast(Client, Offline()), info)
        self.reports: list[ProcessReport] = []

    async def publish(self, subject: str, payload: bytes, msg_id: str, trace: dict[str, str] | None = None) -> None:
        if subject == subjects.agent_report(self.info.name):
            self.reports.append(decode_any(payload, ProcessReport))

    def exits(self) -> list[tuple[str, int, int, int]]:
        return [(r.job_id, r.attempt, r.task, r.rank) for r in self.reports if isinstance(r, ProcessExited)]


class Runner:
    """A runner, its clock and what it published."""

    def __init__(self, ranks: RankRunner, clock: Clock, output: CollectedOutput) -> None:
        self.ranks, self.clock, self.output = ranks, clock, output

    async def start(self, job_id: str, rank: int = 0, *, attempt: int = 1, argv: list[str] | None = None,
                    mounts: list[Mount] | None = None) -> ProcessAccepted:
        request = StartProcess(job_id=job_id, attempt=attempt, job_token=f"token-of-{job_id}", launch=NodeLaunch(
            rank=rank, node=NODE, address="127.0.0.1", argv=argv or [TRUE], env={}, mounts=mounts or []))
        accepted = await self.ranks.accept_start(request)
        assert isinstance(accepted, ProcessAccepted), accepted
        return accepted

    async def all_ended(self) -> None:
        """Wait until every rank here is over: reported, its folder removed, let go."""
        async with asyncio.timeout(WAIT_SECONDS):
            while self.ranks.nodes:
                await asyncio.gather(*[n.runner for n in list(self.ranks.nodes.values()) if n.runner is not None])

    def folders(self) -> list[Path]:
        jobs = self.ranks.root / "jobs"
        return [path for path in jobs.rglob("*") if path.is_dir()] if jobs.exists() else []

    def later(self, seconds: float) -> None:
        """`seconds` pass, and a heartbeat comes."""
        self.clock.now += seconds
        self.ranks.each_beat()


@pytest_asyncio.fixture(loop_scope="session")
async def runner(tmp_path: Path) -> AsyncIterator[Runner]:
    info = NodeInfo(name=NODE, address="127.0.0.1", cpus=1, memory_mib=256)
    root, storage = tmp_path / "agent", tmp_path / "storage"
    storage.mkdir()
    nodes: dict[RankKey, RunningNode] = {}
    data = DataPreparation(DatasetCache(root / "dataset-cache", storage), NODE)
    images = ImagePreparation.from_environment(root, storage, NODE, lambda: data.cache.policy, environ={})
    output, clock = CollectedOutput(info), Clock()
    nc = cast(Client, Offline())
    ranks = RankRunner(nc, info, root=root, storage=storage, nats_url="nats://127.0.0.1:4222", backend=PLAIN,
                       hidden_paths=[], ports=PortBook(29500, 29599, tmp_path / "claims"), data=data, images=images,
                       output=output, debugging=DebugSessions(nc, NODE, root, nodes, images), nodes=nodes,
                       host_interfaces={}, clock=clock)
    data.cache.open()
    ranks.spread_job_folders()
    try:
        yield Runner(ranks, clock, output)
    finally:
        for node in nodes.values():
            if node.group is not None:
                node.group.signal(signal.SIGKILL)
        ranks.leave_running()
        ranks.holders.close()
        data.cache.close()


def held_of(ranks: RankRunner) -> dict[str, Any]:
    """What the runner holds of the ranks that went through it."""
    return {"nodes": dict(ranks.nodes), "ended": dict(ranks.ended), "stopped": dict(ranks.stopped_attempts)}


async def test_ranks_that_ended_are_let_go_and_their_notes_forgotten_after_the_hour(runner: Runner) -> None:
    jobs = [f"job-{n:04d}" for n in range(RANKS)]
    for job_id in jobs:
        assert await runner.start(job_id) == ProcessAccepted(already_known=False)
    # One whose command is not there, one whose dataset is not: neither runs, both are reported.
    assert await runner.start("job-no-command", argv=["/no/such/command"]) == ProcessAccepted(already_known=False)
    assert await runner.start("job-no-data", mounts=[Mount(source="missing", target="/data", read_only=True,
                                                           stage=True)]) == ProcessAccepted(already_known=False)
    await runner.all_ended()
    every = [*jobs, "job-no-command", "job-no-data"]
    assert sorted(runner.output.exits()) == sorted((job_id, 1, 0, 0) for job_id in every)

    # Nothing of them is held but a note each, and no folder is left.
    assert runner.ranks.nodes == {}
    assert sorted(runner.ranks.ended) == sorted((job_id, 1, 0, 0) for job_id in every)
    assert runner.ranks.job_tokens(jobs[0], 1) == []
    assert runner.folders() == []

    # Sent again within the hour: known, and nothing runs.
    runner.later(FORGET_SECONDS - 1)
    for job_id in every:
        assert await runner.start(job_id) == ProcessAccepted(already_known=True)
    await asyncio.sleep(0.3)  # a rank started by mistake would be here, or reported by now
    assert runner.ranks.nodes == {} and runner.folders() == []
    assert len(runner.output.exits()) == len(every)

    # Past the hour, nothing of them is left, as after a restart of the agent.
    runner.later(2)
    assert held_of(runner.ranks) == {"nodes": {}, "ended": {}, "stopped": {}}
    assert await runner.start(jobs[0]) == ProcessAccepted(already_known=False)
    await runner.all_ended()
    assert len(runner.output.exits()) == len(every) + 1


async def test_a_stopped_attempt_starts_nothing_within_the_hour_and_is_forgotten_after(runner: Runner) -> None:
    stopped = await runner.ranks.begin_stop(StopProcesses(job_id="job-stopped", attempt=2, grace_seconds=1))
    assert stopped.stopped == 0  # stopped before any of its starts came

    runner.later(FORGET_SECONDS / 2)
    assert await runner.start("job-stopped", attempt=2) == ProcessAccepted(already_known=True)
    await asyncio.sleep(0.3)
    assert runner.ranks.nodes == {} and runner.output.reports == []

    runner.later(FORGET_SECONDS)
    assert held_of(runner.ranks) == {"nodes": {}, "ended": {}, "stopped": {}}


async def test_nothing_is_forgotten_of_an_attempt_that_still_runs_here(runner: Runner) -> None:
    assert await runner.start("job-long", rank=0, argv=["sleep", "600"]) == ProcessAccepted(already_known=False)
    assert await runner.start("job-long", rank=1) == ProcessAccepted(already_known=False)
    async with asyncio.timeout(WAIT_SECONDS):
        while ("job-long", 1, 0, 1) not in runner.ranks.ended:
            await asyncio.sleep(0.05)

    # Hours later its rank 1 is still known, while rank 0 runs.
    runner.later(2 * FORGET_SECONDS)
    assert list(runner.ranks.ended) == [("job-long", 1, 0, 1)]
    assert await runner.start("job-long", rank=1) == ProcessAccepted(already_known=True)
    assert await runner.start("job-long", rank=0) == ProcessAccepted(already_known=True)
    assert [key for key, node in runner.ranks.nodes.items() if node.is_running()] == [("job-long", 1, 0, 0)]

    # Stopped, it ends; its notes go an hour after the stop.
    stopped = await runner.ranks.begin_stop(StopProcesses(job_id="job-long", attempt=1, grace_seconds=1))
    assert stopped.stopped == 1
    await runner.all_ended()
    runner.later(FORGET_SECONDS - 1)
    for rank in (0, 1):
        assert await runner.start("job-long", rank=rank) == ProcessAccepted(already_known=True)
    runner.later(2)
    assert held_of(runner.ranks) == {"nodes": {}, "ended": {}, "stopped": {}}
    assert sorted(runner.output.exits()) == [("job-long", 1, 0, 0), ("job-long", 1, 0, 1)]
