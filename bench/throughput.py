"""Throughput: how many jobs go from submit to success per second, side by side with Slurm.

    python -m bench.throughput [--jobs 1000] [--agents 8] [--in-flight 16] [--submits 5000] [--array 10000]
                               [--workloads trivial,gang,submit,array] [--no-slurm] [--cpu] [--metrics]
                               [--sync-nats] [--rounds 1] [--trivial-in-flight 16,64,128]
                               [--slurm-in-flight 1,4,16] [--slurm-settings throughput]

Runs the whole local stack as `make up` does (NATS enforcing a login per role, PostgreSQL, the four
services, `--agents` node agents of 16 CPUs and 4000 MiB each), whose servers keep what they acknowledge as
`make up`'s do: handed to the operating system, not synced to disk (a crash of either server loses nothing, a
crash of the machine may; `--sync-nats`: NATS syncs every write first, as deploy/ runs it). Through the Python
client:

- trivial: `--jobs` single-node jobs of one CPU running `true`, once with each of `--trivial-in-flight`
  submissions at a time (16, 64 and 128), in turn on the same stack: the seconds from the first submit to the
  last success (each job's `ended_at`), and the submit rate, of the fastest;
- gang: `--jobs` whole-node PyTorch jobs of 1, 2 and 4 nodes in turn, running `true` on every node;
- submit: `--submits` jobs from 4 clients at once, each with `--in-flight` requests out, into a pool no
  node serves, so they all stay queued: submissions accepted per second (every answer comes after its
  events are committed) and the latency of each, p50 and p99; then, with them queued, how long `list`
  and `show` take to answer; then they are stopped;
- array: one `--array`-job array of trivial jobs, from the submit to the last success.

Every job is a real process started by a real agent. Where Slurm is installed (`apt-get install
slurm-wlm`), the same workloads run on it in the same run (bench/slurm.py: 8 emulated nodes of the same
size, its THROUGHPUT settings: ended jobs forgotten after 2 s and counted from the jobcomp file, cores alone
counted, no authentication, logs of errors only) and the ratio is printed. Slurm runs the trivial workload once
for each of `--slurm-in-flight` (sbatch processes at once: 1, 4 and 16) and keeps the fastest, whose count its
gang workload then uses; each round prints the settings that ran and every count's rate. `--slurm-settings
listed` runs the peer as it ran before (finished jobs listed for an hour, memory packed, munge) for a comparison.
With `--rounds N`, Trainyard and Slurm take turns N times (each on a fresh stack), so that a machine whose speed
drifts within minutes weighs on both alike; each round's ratio is printed, and their median. Within a round each
side's trivial figure is the fastest of three runs (Slurm's counts of sbatch at once, Trainyard's of submissions
at once), tried in an order that turns with the rounds, so that a slow spell of the machine weighs on both alike
too; every run's rate is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench import cpu
from bench.servers import bench_servers
from bench.slurm import IN_FLIGHT, LISTED, THROUGHPUT, SlurmPeer, fastest, in_flight_counts, slurm_missing
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.ops import metrics_env
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef

NODE_CPUS, NODE_MEMORY_MIB = 16, 4000
GANG_SIZES = (1, 2, 4)
SUBMIT_CLIENTS = 4
POLL_SECONDS = 0.2  # as bench/slurm.py polls squeue
SEARCH_LIMIT = 1000
# Submissions at once tried for the trivial workload: more at once let each service decide on more of them together
# (one append for the submissions that came meanwhile, a cycle's admissions, the launcher's plans). Of 15 rounds, 64
# ran the fastest in 8, 128 in 6 and 16 in 1 (up to 34% slower, 16% at the median); 8 and 32 ran slower than 16.
TRIVIAL_IN_FLIGHT = (16, 64, 128)
SLURM_SUBMITS_PER_SECOND = 500.0  # the submission rate Slurm's high-throughput guide documents
ENDED = ("succeeded", "failed", "stopped", "expired")


def cluster_config(path: Path, agents: int) -> Path:
    nodes = "\n".join(f"  - {{name: node-{i}, address: 127.0.0.1, cpus: {NODE_CPUS}, memory_mib: {NODE_MEMORY_MIB}}}"
                      for i in range(1, agents + 1))
    path.write_text("flavors:\n"
                    "  - {name: cpu-1, cpus: 1, memory_mib: 100}\n"
                    f"  - {{name: whole, cpus: {NODE_CPUS}, memory_mib: {NODE_MEMORY_MIB}}}\n"
                    f"nodes:\n{nodes}\n")
    return path


def trivial_spec(index: int | str, *, output: str = "trivial", pool: str | None = None) -> JobSpec:
    return JobSpec(name=f"{output}-{index}", flavors=["cpu-1"], algorithm=AlgorithmRef(name="pytorch-ddp"),
                   command="true", output=OutputRef(name=output), pool=pool)


def gang_spec(index: int) -> JobSpec:
    nodes = GANG_SIZES[index % len(GANG_SIZES)]
    return JobSpec(name=f"gang-{index}", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes,
                   flavors=["whole"], algorithm=AlgorithmRef(name="pytorch-ddp"), command="true",
                   output=OutputRef(name="gang"))


@dataclass
class Run:
    """One workload's figures."""

    jobs: int
    seconds: float  # first submit to last success
    submit_seconds: float  # first submit to last answer
    latencies: list[float] = field(default_factory=list)  # each submission's, in seconds
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else 0.0

    @property
    def submit_rate(self) -> float:
        return self.jobs / self.submit_seconds if self.submit_seconds else 0.0


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


async def submit_all(clients: Sequence[TrainyardClient], specs: Sequence[JobSpec],
                     in_flight: int) -> tuple[list[str], list[float], float, float]:
    """Submit every spec, `in_flight` requests out per client; the ids, each latency, first and last answer."""
    queue: asyncio.Queue[JobSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    ids: list[str] = []
    latencies: list[float] = []
    began = time.monotonic()

    async def worker(client: TrainyardClient) -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            sent = time.monotonic()
            accepted = await client.submit(spec)
            latencies.append(time.monotonic() - sent)
            ids.append(accepted.job_id)

    await asyncio.gather(*(worker(client) for client in clients for _ in range(in_flight)))
    return ids, latencies, began, time.monotonic()


async def ended(api: TrainyardClient, output: str, count: int,
                progress: Callable[[str], None]) -> tuple[float, dict[str, int]]:
    """Wait until no job is queued or running; when that was seen (time.monotonic(), polled as Slurm's side is),
    and how many of the workload's `count` jobs ended each way."""
    while await api.list_jobs(["queued", "running"], limit=1):
        await asyncio.sleep(POLL_SECONDS)
    seen = time.monotonic()
    # A search answers at most SEARCH_LIMIT jobs: a count at that limit is a lower bound.
    statuses = {status: len(await api.search(output=output, statuses=[status], limit=SEARCH_LIMIT))
                for status in ("failed", "stopped", "expired")}
    for failed in (await api.search(output=output, statuses=["failed"], limit=3)):
        progress(f"  failed: {failed.job_id}: {(await api.get_job(failed.job_id)).job.reason}")
    statuses = {status: found for status, found in statuses.items() if found}
    shown = [f"{status} {found}{'+' if found >= SEARCH_LIMIT else ''}" for status, found in statuses.items()]
    if all(found < SEARCH_LIMIT for found in statuses.values()):  # the rest succeeded, exactly counted
        statuses["succeeded"] = count - sum(statuses.values())
        shown.insert(0, f"succeeded {statuses['succeeded']}")
    progress("  ended: " + ", ".join(shown))
    return seen, statuses


async def through(api: TrainyardClient, clients: Sequence[TrainyardClient], specs: Sequence[JobSpec],
                  in_flight: int, progress: Callable[[str], None], *, cpu_of: Sequence[Path] = ()) -> Run:
    """Submit `specs` (all with one output) and wait for them all to end: the workload's figures, and with
    `cpu_of` (the run's folders) where its processes' CPU went meanwhile."""
    output = specs[0].output.name if specs[0].output else ""
    before = cpu.look(*cpu_of)
    ids, latencies, began, answered = await submit_all(clients, specs, in_flight)
    progress(f"  {len(ids)} submitted in {answered - began:.1f} s")
    done, statuses = await ended(api, output, len(specs), progress)
    if cpu_of:
        progress("\n".join(cpu.table(cpu.spent(before, cpu.look(*cpu_of)), len(specs))))
    way = await steps(api, ids[len(ids) // 2:len(ids) // 2 + 50])
    progress("  median seconds to " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in way.items()))
    return Run(jobs=len(specs), seconds=done - began, submit_seconds=answered - began, latencies=latencies,
               statuses=statuses)


# The steps of a job's way, each ending at the first event of its kind in the job's history.
STEPS = (("JobSubmitted", "submitted"), ("JobAdmitted", "admitted"), ("LaunchPlanned", "planned"),
         ("NodeProcessStarted", "started"), ("NodeProcessExited", "exited"), ("JobSucceeded", "succeeded"))


async def steps(api: TrainyardClient, job_ids: Sequence[str]) -> dict[str, float]:
    """The median seconds between the steps of the jobs' way, from their histories."""
    gaps: dict[str, list[float]] = {}
    for job_id in job_ids:
        seen: dict[str, datetime] = {}
        for envelope in await api.history(job_id):
            seen.setdefault(type(envelope.event).name(), envelope.recorded_at)
        for (before, _), (after, name) in itertools.pairwise(STEPS):
            if before in seen and after in seen:
                gaps.setdefault(name, []).append((seen[after] - seen[before]).total_seconds())
    return {name: statistics.median(values) for name, values in gaps.items()}


async def timed(call: Callable[[], Awaitable[object]], times: int) -> list[float]:
    seconds = []
    for _ in range(times):
        began = time.monotonic()
        await call()
        seconds.append(time.monotonic() - began)
    return seconds


@dataclass
class Figures:
    runs: dict[str, Run] = field(default_factory=dict)
    queries: dict[str, list[float]] = field(default_factory=dict)
    prediction_lag: float | None = None  # from the last submission's answer to its prediction recorded
    queued: int = 0  # jobs queued while `queries` were timed
    tried: dict[int, float] = field(default_factory=dict)  # the trivial workload's jobs/s by submissions at once
    in_flight: int = 0  # the count of the fastest, its figure


def turned(counts: Sequence[int], turn: int) -> tuple[int, ...]:
    """The counts to try in round `turn`, in an order that turns with each round, so that none is always first."""
    shift = (turn - 1) % len(counts)
    return (*counts[shift:], *counts[:shift])


async def trainyard(args: argparse.Namespace, home: Path, progress: Callable[[str], None],
                    turn: int = 1) -> Figures:
    figures = Figures()
    async with bench_servers("throughput") as servers:
        stack = Stack(home / "stack", None, servers.database_url, connect=TrainyardClient.open,
                      cluster=cluster_config(home / "cluster.yaml", args.agents), timings={},
                      env=metrics_env(home / "stack") if args.metrics else None, sync_nats_writes=args.sync_nats)
        clients: list[TrainyardClient] = []
        try:
            progress(f"starting the stack with {args.agents} agents")
            api = await stack.up()
            # One user submits every job, far faster and more of them than a person's limits allow.
            await api.change_settings(max_queued_jobs_per_user=0, submit_rate=0)
            clients = [await TrainyardClient.open(stack.nats_url, token=stack.token) for _ in range(SUBMIT_CLIENTS)]
            workloads = args.workloads.split(",")
            ours = (home, servers.home) if args.cpu else ()  # the folders that name this run's processes
            if "trivial" in workloads:
                tries: dict[int, Run] = {}
                for count in turned(args.trivial_in_flight, turn):
                    progress(f"trivial: {args.jobs} single-node jobs running `true`, {count} submissions at once")
                    specs = [trivial_spec(i, output=f"trivial-{count}") for i in range(args.jobs)]
                    tries[count] = await through(api, clients[:1], specs, count, progress, cpu_of=ours)
                figures.tried = {count: tries[count].rate for count in sorted(tries)}
                figures.in_flight = max(tries, key=lambda count: tries[count].rate)
                figures.runs["trivial"] = tries[figures.in_flight]
            if "gang" in workloads:
                progress(f"gang: {args.jobs} whole-node jobs of 1, 2 and 4 nodes")
                figures.runs["gang"] = await through(api, clients[:1], [gang_spec(i) for i in range(args.jobs)],
                                                     args.in_flight, progress, cpu_of=ours)
            if "submit" in workloads:
                progress(f"submit: {args.submits} jobs from {SUBMIT_CLIENTS} clients, left queued")
                specs = [trivial_spec(i, output="held", pool="held") for i in range(args.submits)]
                before = cpu.look(*ours)
                ids, latencies, began, answered = await submit_all(clients, specs, args.in_flight)
                if ours:
                    progress("\n".join(cpu.table(cpu.spent(before, cpu.look(*ours)), len(ids))))
                figures.runs["submit"] = Run(jobs=len(ids), seconds=0.0, submit_seconds=answered - began,
                                             latencies=latencies)
                progress(f"  {len(ids)} accepted in {answered - began:.1f} s")
                while (await api.get_job(ids[-1])).job.prediction is None:  # planned after it, in batches
                    await asyncio.sleep(0.1)
                figures.prediction_lag = time.monotonic() - answered
                for start in range(0, len(ids), 1000):
                    await api.stop(ids[start:start + 1000])
                await ended(api, "held", len(ids), progress)
            if "array" in workloads:
                progress(f"array: one array of {args.array} single-node jobs running `true`")
                began = time.monotonic()
                accepted = await api.submit_array(trivial_spec("{index}", output="array"),
                                                  indices=f"0-{args.array - 1}")
                answered = time.monotonic()
                progress(f"  accepted in {answered - began:.1f} s; timing list and show while they are queued")
                figures.queued = sum((await api.listing(["queued"])).arrays[0].statuses.values())
                figures.queries["list"] = await timed(api.listing, 20)
                figures.queries["show"] = await timed(lambda: api.get_job(accepted.job_ids[-1]), 20)
                done, statuses = await ended(api, "array", args.array, progress)
                figures.runs["array"] = Run(jobs=args.array, seconds=done - began, submit_seconds=answered - began,
                                            latencies=[answered - began], statuses=statuses)
        finally:
            for client in clients:
                await client.close()
            await stack.close()
    return figures


def tries_line(what: str, tried: dict[int, float], kept: int) -> str:
    """A side's trivial runs of a round: each count's jobs/s, and the count kept (the fastest)."""
    return f"{what}: " + ", ".join(f"{count}: {rate:.1f} jobs/s" for count, rate in tried.items()) + f"; kept {kept}"


@dataclass
class SlurmSide:
    """What the Slurm peer did in one round: its jobs/s by workload, the settings that ran, and the trivial
    workload's rate at each count of sbatch at once tried (the fastest is its figure)."""

    rates: dict[str, float] = field(default_factory=dict)
    settings: str = ""
    tried: dict[int, float] = field(default_factory=dict)
    in_flight: int = 0  # the count kept, which the gang workload ran with

    def lines(self) -> list[str]:
        lines = [f"Slurm ran with {self.settings}"]
        if self.tried:
            lines.append(tries_line("Slurm trivial by sbatch at once", self.tried, self.in_flight))
        return lines


async def slurm_side(args: argparse.Namespace, folder: Path, progress: Callable[[str], None],
                     turn: int = 1) -> SlurmSide:
    """The same workloads on a real Slurm of as many nodes of the same size (bench/slurm.py): jobs/s each. The
    counts of sbatch at once are tried in an order that turns with each round, so that none is always first."""
    folder.mkdir()
    side = SlurmSide()
    settings = LISTED if args.slurm_settings == "listed" else THROUGHPUT
    async with SlurmPeer(folder, nodes=args.agents, cpus=NODE_CPUS, memory_mib=NODE_MEMORY_MIB,
                         max_array=max(args.array, 1), settings=settings) as peer:
        side.settings = peer.describe()
        progress(f"Slurm: {side.settings}")
        order = turned(args.slurm_in_flight, turn)
        side.in_flight = order[0]
        workloads = args.workloads.split(",")
        if "trivial" in workloads:
            progress(f"Slurm trivial: {args.jobs} jobs, one sbatch each, {', '.join(map(str, order))} at once in turn")
            before = cpu.look(folder)
            tried = await peer.run_trivial_fastest(args.jobs, order, progress)
            if args.cpu:
                progress("\n".join(cpu.table(cpu.spent(before, cpu.look(folder)), args.jobs * len(tried))))
            kept = fastest(tried)
            side.tried = {result.in_flight: result.jobs_per_second
                          for result in sorted(tried, key=lambda result: result.in_flight)}
            side.rates["trivial"], side.in_flight = kept.jobs_per_second, kept.in_flight
        if "gang" in workloads:
            progress(f"Slurm gang: {args.jobs} --exclusive jobs of 1, 2 and 4 nodes running srun true, "
                     f"{side.in_flight} sbatch at once")
            side.rates["gang"] = (await peer.run_gang(args.jobs, GANG_SIZES, side.in_flight)).jobs_per_second
        if "array" in workloads and args.array:
            progress(f"Slurm array: sbatch --array=0-{args.array - 1}")
            side.rates["array"] = (await peer.run_array(args.array)).jobs_per_second
    return side


def report(figures: Figures, side: SlurmSide | None) -> list[str]:
    slurm = side.rates if side else None
    lines = [f"{'workload':<10} {'jobs':>6} {'seconds':>8} {'jobs/s':>8} {'submit/s':>9} "
             f"{'p50 ms':>7} {'p99 ms':>7} {'Slurm jobs/s':>13} {'ratio':>6}"]
    for name, run in figures.runs.items():
        peer = slurm.get(name) if slurm else None
        if name == "submit":  # nothing runs: submissions against Slurm's documented figure
            peer, ratio = SLURM_SUBMITS_PER_SECOND, f"{run.submit_rate / SLURM_SUBMITS_PER_SECOND:.2f}"
        else:
            ratio = f"{run.rate / peer:.2f}" if peer and run.seconds else "-"
        rate = f"{run.rate:.1f}" if run.seconds else "-"
        lines.append(f"{name:<10} {run.jobs:>6} {run.seconds:>8.1f} {rate:>8} {run.submit_rate:>9.1f} "
                     f"{percentile(run.latencies, 0.5) * 1000:>7.0f} {percentile(run.latencies, 0.99) * 1000:>7.0f} "
                     f"{(f'{peer:.1f}' if peer else '-'):>13} {ratio:>6}")
    if "submit" in figures.runs:
        lines.append(f"(submit: submissions/s against the {SLURM_SUBMITS_PER_SECOND:.0f}/s of Slurm's "
                     "high-throughput guide)")
    for name, seconds in figures.queries.items():
        lines.append(f"{name} while {figures.queued} jobs were queued: p50 "
                     f"{percentile(seconds, 0.5) * 1000:.0f} ms, max {max(seconds) * 1000:.0f} ms")
    if len(figures.tried) > 1:
        lines.append(tries_line("Trainyard trivial by submissions at once", figures.tried, figures.in_flight))
    if figures.prediction_lag is not None:
        lines.append(f"the last submission's prediction was recorded {figures.prediction_lag:.1f} s after its answer")
    if side is not None:
        lines += side.lines()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--submits", type=int, default=5000)
    parser.add_argument("--array", type=int, default=10000)
    parser.add_argument("--workloads", default="trivial,gang,submit,array")
    parser.add_argument("--no-slurm", action="store_true")
    parser.add_argument("--cpu", action="store_true",
                        help="where the CPU went in the trivial, gang and submit workloads")
    parser.add_argument("--metrics", action="store_true",
                        help="every process serves its metrics, as `make up` runs them (what they cost)")
    parser.add_argument("--sync-nats", action="store_true",
                        help="the stack's NATS syncs every write to disk before it acknowledges it, as deploy/ runs it")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Trainyard and Slurm take turns this many times; each round's ratio and their median")
    parser.add_argument("--trivial-in-flight", type=in_flight_counts, default=TRIVIAL_IN_FLIGHT,
                        help="submissions at once Trainyard's trivial workload tries, each in turn on one stack (the "
                             "fastest counts, as Slurm's fastest count of sbatch at once does); default 16,64,128")
    parser.add_argument("--slurm-in-flight", type=in_flight_counts, default=IN_FLIGHT,
                        help="sbatch processes at once that Slurm's trivial workload tries, each in turn (the "
                             "fastest counts, and its gang workload uses it); default 1,4,16")
    parser.add_argument("--slurm-settings", choices=("throughput", "listed"), default="throughput",
                        help="the peer's THROUGHPUT settings, or LISTED's (ended jobs listed for an hour, memory "
                             "packed, munge), as it ran before")
    args = parser.parse_args()

    def progress(line: str) -> None:
        print(line, flush=True)

    rounds: list[tuple[Figures, SlurmSide | None]] = []
    with tempfile.TemporaryDirectory(prefix="trainyard-throughput-") as workdir:
        top = Path(workdir)
        top.chmod(0o755)
        missing = None if args.no_slurm else slurm_missing()
        if missing is not None:
            progress(f"no Slurm beside it: {missing}")
        for turn in range(1, args.rounds + 1):
            if args.rounds > 1:
                progress(f"round {turn} of {args.rounds}")
            home = top / f"round-{turn}"
            home.mkdir(mode=0o755)
            figures = asyncio.run(trainyard(args, home, progress, turn))
            slurm = None if args.no_slurm or missing is not None else asyncio.run(
                slurm_side(args, home / "slurm", progress, turn))
            rounds.append((figures, slurm))
    for turn, (figures, slurm) in enumerate(rounds, 1):
        print()
        if args.rounds > 1:
            print(f"round {turn}")
        print("\n".join(report(figures, slurm)))
    if len(rounds) > 1:
        print()
        print("\n".join(summary(rounds)))


def summary(rounds: Sequence[tuple[Figures, SlurmSide | None]]) -> list[str]:
    """Per workload run on both sides: each round's ratio and their median."""
    lines = []
    for name in rounds[0][0].runs:
        ratios = [figures.runs[name].rate / side.rates[name] for figures, side in rounds
                  if side and side.rates.get(name) and figures.runs[name].seconds]
        if ratios:
            lines.append(f"{name}: ratio to Slurm by round {', '.join(f'{r:.2f}' for r in ratios)}; "
                         f"median {statistics.median(ratios):.2f}")
    return lines


if __name__ == "__main__":
    main()
