"""bench/gang.py, short: gang jobs on the real services with a few simulated nodes all succeed and each has its
launch measured; and where Slurm is installed, its peer runs jobs of two whole nodes and reads their launches."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gang import report, slurm, trainyard
from bench.slurm import slurm_missing

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]


async def test_gang_jobs_on_simulated_nodes_succeed_with_their_launch_measured(tmp_path: Path, nats_url: str,
                                                                               database_url: str) -> None:
    tmp_path.chmod(0o755)
    rows = await trainyard(tmp_path, nats_url, database_url, [2, 4, 16], nodes=8, jobs=6, in_flight=4, alone=2,
                           progress=print)

    two, four, sixteen = rows
    assert sixteen.note == "over the 8 simulated nodes"
    for row, size in ((two, 2), (four, 4)):
        assert not row.note, row.note
        assert row.nodes == size and row.jobs == 6 and row.rate > 0
        assert len(row.launches) == 6 and all(0 < seconds < 30 for seconds in row.launches)
        assert len(row.alone) == 2 and all(0 < seconds < 30 for seconds in row.alone)
    print("\n".join(report(rows)))


@pytest.mark.skipif(slurm_missing() is not None, reason="Slurm is not installed (apt-get install slurm-wlm)")
async def test_the_slurm_peer_runs_whole_node_jobs_and_reads_each_launch() -> None:
    rows = await slurm([2, 4], nodes=2, jobs=3, in_flight=2, alone=1, progress=print)

    two, four = sorted(rows, key=lambda row: row.nodes)
    assert four.note == "over the 2 emulated nodes"
    assert not two.note, two.note
    assert two.jobs == 3 and two.rate > 0 and len(two.launches) == 3 and len(two.alone) == 1
    # From the allocation, the batch script starts first, then every rank.
    assert all(0 < script < launch < 30 for script, launch in zip(two.to_script, two.launches, strict=True))
