"""Jobs of a thousand nodes, on the real services with simulated nodes (bench/simnodes.py, bench/simagents.py).

A job of 1,024 nodes in every distributed mode is placed all-or-nothing, has every rank started and stops when its
user stops it; a checkpoint-resume job of 256 nodes that loses one of them resumes on the others and the spare.
The sizes can be made smaller for a quick look: LARGE_JOB_NODES, RESUMED_JOB_NODES.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from bench.launch_scale import (
    MODES,
    SimulatedStack,
    all_running,
    events_of,
    large_spec,
    launched,
    simulated_stack,
    wait_status,
)
from client.api import TrainyardError
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobResuming,
    JobStopped,
    JobStopRequested,
    LaunchStopped,
)
from libs.contracts.jobspec import CheckpointResume

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

LARGE_NODES = int(os.environ.get("LARGE_JOB_NODES", "1024"))
RESUMED_NODES = int(os.environ.get("RESUMED_JOB_NODES", "256"))
POOL = "resilient"


@contextlib.asynccontextmanager
async def simulated(tmp_path: Path, nats_url: str, database_url: str, nodes: int, *, heartbeat_seconds: float,
                    lost_seconds: float, pools: Sequence[str] = ()) -> AsyncIterator[SimulatedStack]:
    """The stack with `nodes` simulated nodes; its services' logs are printed at the end (pytest shows them only
    when the test failed)."""
    tmp_path.chmod(0o755)
    found: SimulatedStack | None = None
    try:
        async with simulated_stack(tmp_path, nats_url, database_url, nodes, heartbeat_seconds=heartbeat_seconds,
                                   lost_seconds=lost_seconds, pools=pools, say=print) as sim:
            found = sim
            try:
                yield sim
            finally:
                print(sim.stack.dump_logs())
    finally:
        if found is None:  # it did not come up: its logs tell why
            print(*(p.read_text(errors="replace")[-4000:] for p in sorted(tmp_path.glob("stack/logs/*.log"))))


def of_kind(events: Sequence[EventEnvelope], kind: type, attempt: int | None = None) -> list[EventEnvelope]:
    return [e for e in events if isinstance(e.event, kind)
            and (attempt is None or getattr(e.event, "attempt", None) == attempt)]


# Nodes are counted lost only after a long silence: a launch of 1,024 nodes keeps this machine busy.
async def test_jobs_of_1024_nodes_run_in_every_mode_and_stop(tmp_path: Path, nats_url: str, database_url: str) -> None:
    nodes = LARGE_NODES
    async with simulated(tmp_path, nats_url, database_url, nodes, heartbeat_seconds=2, lost_seconds=30) as sim:
        api = sim.api
        for mode in MODES:
            accepted = await api.submit(large_spec(mode, nodes, f"large-{mode}"))

            job = await wait_status(api, accepted.job_id, all_running(1), timeout=120)
            assert job.status == "running", (mode, job.status, job.reason)
            # What `show` tells: every rank on a node of its own, each started.
            assert job.nodes == nodes and job.attempt == 1
            assert sorted(i.rank for i in job.instances) == list(range(nodes)), mode
            assert len({i.node for i in job.instances}) == nodes, mode
            assert {p.node for p in job.placement} == {i.node for i in job.instances}
            assert [i.rank for i in job.instances if i.master] == [0]

            events = await events_of(api, accepted.job_id, 1, nodes)
            [admission] = of_kind(events, JobAdmitted)
            assert isinstance(admission.event, JobAdmitted)
            seen = launched(events, 1)
            assert len(set(seen.placement.values())) == nodes, mode  # all of them at once, each its own node
            assert seen.started == seen.placement, mode  # every rank started once, where it was placed
            print(f"{mode} x {nodes}: admitted {seen.admission_seconds:.2f} s after its submit, every rank started "
                  f"{seen.launch_seconds:.2f} s after its admission")

            await api.stop([accepted.job_id])
            ended = await wait_status(api, accepted.job_id, lambda job: False, timeout=120)
            assert ended.status == "stopped", (mode, ended.status, ended.reason)
            assert not [i for i in ended.instances if i.state == "running"], mode
            answered = sim.agents.answered[("stop", accepted.job_id, 1)]
            assert answered.nodes == set(seen.placement.values()), mode  # every node's stop was answered
            try:
                history = await api.events(accepted.job_id)
            except TrainyardError as exc:  # what `trainyard history` would answer
                pytest.fail(f"{mode}: the events of a stopped job of {nodes} nodes cannot be read: {exc}")
            names = [type(e.event) for e in history]
            assert names.index(JobStopRequested) < names.index(LaunchStopped) < names.index(JobStopped), mode


async def test_a_checkpoint_job_of_256_nodes_resumes_without_its_lost_node(tmp_path: Path, nats_url: str,
                                                                          database_url: str) -> None:
    nodes = RESUMED_NODES
    async with simulated(tmp_path, nats_url, database_url, nodes + 1, heartbeat_seconds=1, lost_seconds=4,
                         pools=[POOL]) as sim:
        api = sim.api
        spec = large_spec("pytorch", nodes, "resumed", pool=POOL,
                          checkpoint_resume=CheckpointResume(max_resumes=2, graceful_shutdown_seconds=5))
        accepted = await api.submit(spec)
        first = await wait_status(api, accepted.job_id, all_running(1), timeout=120)
        assert first.status == "running", (first.status, first.reason)
        placed = {p.node for p in first.placement}
        [spare] = set(sim.fleet.names) - placed
        lost = next(p.node for p in first.placement if p.rank == 0)  # the master's: the hardest one to lose

        sim.fleet.beats.silence(lost)  # its heartbeats stop, and its agent answers nothing more
        sim.agents.silence(lost)

        job = await wait_status(api, accepted.job_id, all_running(2), timeout=120)
        assert job.status == "running", (job.status, job.reason)
        assert job.attempt == 2 and job.resumes == 1
        assert {i.node for i in job.instances} == placed - {lost} | {spare}
        assert sorted(i.rank for i in job.instances) == list(range(nodes))
        assert {n.info.name: n.status for n in await api.nodes()}[lost] == "lost"

        events = await events_of(api, accepted.job_id, 2, nodes)
        [resuming] = of_kind(events, JobResuming, attempt=1)
        assert isinstance(resuming.event, JobResuming)
        assert resuming.event.lost_nodes == [lost] and f"node {lost} was lost" in resuming.event.reason
        seen = launched(events, 2)
        assert set(seen.placement.values()) == placed - {lost} | {spare}
        assert seen.started == seen.placement  # every rank of the new attempt started, none on the lost node
        assert resuming.recorded_at < seen.admitted
        # The old attempt was stopped on every node that could still answer.
        assert sim.agents.answered[("stop", accepted.job_id, 1)].nodes == placed - {lost}
        print(f"resumed on {nodes} nodes: admitted {(seen.admitted - resuming.recorded_at).total_seconds():.2f} s "
              f"after JobResuming, every rank started {seen.launch_seconds:.2f} s after its admission")
