"""Gang jobs of 8, 32 and 128 nodes: jobs a second and each job's launch, beside Slurm's `srun -N` on its nodes.

    python -m bench.gang [--sizes 8,32,128] [--nodes 256] [--jobs 40] [--in-flight 16] [--alone 5]
                         [--slurm-nodes 128] [--slurm-jobs 20] [--slurm-in-flight 4] [--no-slurm]

Trainyard: the four real services on the tests' NATS and PostgreSQL with `--nodes` simulated nodes, each
registering and heartbeating with its own credential, and simulated agents answering the launcher's ports and
start requests (bench/launch_scale.py's stack, bench/simnodes.py, bench/simagents.py), whose processes are
reported started and then exited with code 0 at once: a job succeeds once every rank has started and ended, and
nothing runs. For each size k, `--jobs` PyTorch jobs of k whole nodes are submitted, `--in-flight` requests out,
and run to success. Measured: jobs a second, from the first submit until no job is queued or running (polled every
0.2 s, as bench/throughput.py does), and each job's launch from its events, JobAdmitted to the last of its
NodeProcessStarted (p50 and p95, and the p50 per node). Jobs run together share the launcher (and, on Slurm's
side, the machine's two cores with every slurmstepd), so then `--alone` jobs of each size run one at a time, on an
idle cluster: their launch is the launch path's own cost, and its growth from one size to the next the cost of
each node added.

Slurm (bench/slurm.py, where it is installed): one `slurmctld` and `--slurm-nodes` emulated nodes, a `slurmd`
each on this host, with the peer's throughput settings but slurmctld's log at `info`, where each job's allocation
is read to the millisecond. For each size that fits, `--slurm-jobs` jobs of `sbatch --exclusive -N k --wrap
'date +%s.%N; srun date +%s.%N'`, `--slurm-in-flight` sbatch at once: every node runs a step's task, a real
process, each printing when it started. Measured the same way: jobs a second from the first submit until the
jobcomp file holds them all (each checked COMPLETED), and the launch from the allocation to the last rank's start,
with the part up to the batch script's start; then `--alone` jobs one at a time. Slurm's emulated nodes are
processes on this machine (128 slurmd start in a few seconds on 2 cores and 24 GiB), so the largest size depends
on how many slurmd it holds: a peer that cannot start says so in the report, and the sizes over `--slurm-nodes`
are left out. A node Slurm frees is given to the next job at slurmctld's next scheduling pass after the job's
end, about once a second, which bounds its jobs a second at every size.

The two launch paths differ in what a rank is: on Trainyard's side a simulated agent that answers at once, on
Slurm's a process forked by a real slurmstepd on an emulated node. Both count from the scheduler's decision to
the last rank started.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.launch_scale import launched, simulated_stack
from bench.servers import bench_servers
from bench.slurm import THROUGHPUT, Launch, SlurmPeer, slurm_missing, slurm_version
from bench.throughput import ended, submit_all
from client.api import TrainyardClient
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef

SIZES = (8, 32, 128)
FLAVOR = "whole-node"  # bench/launch_scale.py's: a simulated node fits it once
EVENTS_AT_ONCE = 8  # jobs whose events are read at once after a run


def gang_spec(nodes: int, index: int, output: str) -> JobSpec:
    """Job `index` of a run of `nodes`-node jobs, whose output names the run: PyTorch on `nodes` whole nodes (the
    simulated agents run nothing of it)."""
    return JobSpec(name=f"{output}-{index}", mode="pytorch", nodes=nodes, flavors=[FLAVOR],
                   algorithm=AlgorithmRef(name="pytorch-ddp"), command="true", output=OutputRef(name=output))


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value at `fraction` of the sorted values, interpolated; NaN for none."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]


@dataclass
class Row:
    """One size on one system."""

    system: str
    nodes: int
    jobs: int = 0
    seconds: float = 0.0  # first submit to the last job done
    launches: list[float] = field(default_factory=list)  # each job's, admission to every rank started, seconds
    to_script: list[float] = field(default_factory=list)  # Slurm: allocation to the batch script's start
    alone: list[float] = field(default_factory=list)  # launches of jobs run one at a time, on an idle cluster
    note: str = ""  # why there are no figures

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else float("nan")


async def trainyard_size(api: TrainyardClient, nodes: int, jobs: int, in_flight: int,
                         progress: Callable[[str], None], output: str = "") -> Row:
    """`jobs` jobs of `nodes` nodes, submitted together and run to success; their output (`gang<nodes>` unless
    given) names them alone."""
    output = output or f"gang{nodes}"
    specs = [gang_spec(nodes, i, output) for i in range(jobs)]
    ids, _, began, answered = await submit_all([api], specs, in_flight)
    progress(f"  {len(ids)} jobs of {nodes} nodes submitted in {answered - began:.1f} s")
    done, statuses = await ended(api, output, jobs, progress)
    row = Row("Trainyard", nodes, jobs=jobs, seconds=done - began)
    if statuses.get("succeeded") != jobs:
        row.note = f"not every job succeeded: {statuses}"
        return row
    gate = asyncio.Semaphore(EVENTS_AT_ONCE)

    async def launch(job_id: str) -> float:
        async with gate:
            return launched(await api.events(job_id), 1).launch_seconds

    row.launches = list(await asyncio.gather(*(launch(job_id) for job_id in ids)))
    return row


async def trainyard(home: Path, nats_url: str, database_url: str, sizes: Sequence[int], *, nodes: int, jobs: int,
                    in_flight: int, alone: int, progress: Callable[[str], None]) -> list[Row]:
    """Each size's run on a stack under `home` with `nodes` simulated nodes, then `alone` jobs of it one at a
    time."""
    rows = []
    async with simulated_stack(home, nats_url, database_url, nodes, say=progress) as sim:
        sim.agents.seconds = 0.0  # every process exits as soon as it is reported started
        # One user submits every job, more and faster than a person's limits allow.
        await sim.api.change_settings(max_queued_jobs_per_user=0, submit_rate=0)
        for size in sizes:
            if size > nodes:
                rows.append(Row("Trainyard", size, note=f"over the {nodes} simulated nodes"))
                continue
            progress(f"Trainyard: {jobs} jobs of {size} nodes on {nodes} simulated nodes")
            rows.append(row := await trainyard_size(sim.api, size, jobs, in_flight, progress))
            for index in range(alone):
                progress(f"Trainyard: a job of {size} nodes alone ({index + 1} of {alone})")
                alone_row = await trainyard_size(sim.api, size, 1, 1, lambda _: None, f"gang{size}-alone{index}")
                if alone_row.note:
                    row.note = f"a job alone: {alone_row.note}"
                row.alone += alone_row.launches
    return rows


def slurm_row(nodes: int, launches: Sequence[Launch], jobs: int, seconds: float) -> Row:
    return Row("Slurm", nodes, jobs=jobs, seconds=seconds, launches=[launch.seconds for launch in launches],
               to_script=[launch.script - launch.allocated for launch in launches])


async def slurm(sizes: Sequence[int], *, nodes: int, jobs: int, in_flight: int, alone: int,
                progress: Callable[[str], None]) -> list[Row]:
    """Each size on a Slurm peer of `nodes` emulated nodes, then `alone` jobs of it one at a time; a row with a
    note for those it cannot run."""
    fits = [size for size in sizes if size <= nodes]
    rows = [Row("Slurm", size, note=f"over the {nodes} emulated nodes") for size in sizes if size > nodes]
    with tempfile.TemporaryDirectory(prefix="trainyard-gang-slurm-") as workdir:
        peer = SlurmPeer(Path(workdir), nodes=nodes, settings=replace(THROUGHPUT, debug="info"))
        progress(f"Slurm: {slurm_version()}, {peer.describe()}")
        began = time.monotonic()
        try:
            async with peer:
                progress(f"  {peer.nodes} slurmd idle after {time.monotonic() - began:.1f} s")
                for size in fits:
                    progress(f"Slurm: {jobs} jobs of sbatch --exclusive -N {size} running srun, "
                             f"{in_flight} sbatch at once")
                    result, launches = await peer.run_wide(jobs, size, in_flight)
                    rows.append(row := slurm_row(size, launches, result.jobs, result.seconds))
                    for _ in range(alone):
                        row.alone += [launch.seconds for launch in (await peer.run_wide(1, size))[1]]
        except RuntimeError as exc:  # the peer did not start, or a workload failed: said in the report
            progress(f"  Slurm: {exc}")
            done = {row.nodes for row in rows}
            rows += [Row("Slurm", size, note=str(exc).split(";")[0]) for size in fits if size not in done]
    return rows


def report(rows: Sequence[Row]) -> list[str]:
    lines = [f"{'nodes':>5} {'system':<10} {'jobs':>5} {'seconds':>8} {'jobs/s':>7} {'launch p50':>11} "
             f"{'p95':>7} {'per node':>9} {'to script':>10} {'alone p50':>10}"]
    for row in sorted(rows, key=lambda row: (row.nodes, row.system != "Trainyard")):
        if row.note:
            lines.append(f"{row.nodes:>5} {row.system:<10} {row.note}")
            continue
        p50 = percentile(row.launches, 0.5)
        script = f"{percentile(row.to_script, 0.5) * 1000:.0f} ms" if row.to_script else "-"
        alone = f"{percentile(row.alone, 0.5) * 1000:.0f} ms" if row.alone else "-"
        lines.append(f"{row.nodes:>5} {row.system:<10} {row.jobs:>5} {row.seconds:>8.1f} {row.rate:>7.1f} "
                     f"{p50 * 1000:>8.0f} ms {percentile(row.launches, 0.95) * 1000:>4.0f} ms "
                     f"{p50 / row.nodes * 1000:>6.2f} ms {script:>10} {alone:>10}")
    lines.append("(launch: admission to every rank started, p50 and p95 of the jobs run together; per node: the p50 "
                 "over the nodes; to script: Slurm's allocation to the batch script's start, p50; alone: the launch "
                 "of jobs run one at a time, p50)")
    for system in dict.fromkeys(row.system for row in rows):
        measured = sorted((row.nodes, percentile(row.alone, 0.5)) for row in rows
                          if row.system == system and row.alone)
        if len(measured) > 1:
            added = ", ".join(f"{a}->{b}: {(later - earlier) / (b - a) * 1000:.1f} ms"
                              for (a, earlier), (b, later) in itertools.pairwise(measured))
            lines.append(f"{system}: each node added to a launch alone (p50) costs {added}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="nodes a job, comma-separated")
    parser.add_argument("--nodes", type=int, default=256, help="Trainyard's simulated nodes")
    parser.add_argument("--jobs", type=int, default=40, help="Trainyard's jobs of each size")
    parser.add_argument("--in-flight", type=int, default=16, help="Trainyard's submissions out at once")
    parser.add_argument("--alone", type=int, default=5, help="jobs of each size then run one at a time, each side")
    parser.add_argument("--slurm-nodes", type=int, default=128, help="Slurm's emulated nodes (a slurmd each)")
    parser.add_argument("--slurm-jobs", type=int, default=20, help="Slurm's jobs of each size")
    parser.add_argument("--slurm-in-flight", type=int, default=4, help="sbatch processes at once")
    parser.add_argument("--no-slurm", action="store_true")
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.sizes.split(",")})

    def progress(line: str) -> None:
        print(line, flush=True)

    async def ours() -> list[Row]:
        async with bench_servers("gang") as servers:
            return await trainyard(servers.home / "run", servers.nats_url, servers.database_url, sizes,
                                   nodes=args.nodes, jobs=args.jobs, in_flight=args.in_flight, alone=args.alone,
                                   progress=progress)

    rows = asyncio.run(ours())
    missing = None if args.no_slurm else slurm_missing()
    if missing is not None:
        progress(f"no Slurm beside it: {missing}")
    elif not args.no_slurm:
        rows += asyncio.run(slurm(sizes, nodes=args.slurm_nodes, jobs=args.slurm_jobs, in_flight=args.slurm_in_flight,
                                  alone=args.alone, progress=progress))
    print()
    print("\n".join(report(rows)))


if __name__ == "__main__":
    main()
