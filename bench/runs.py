"""Runs (R1, R2): how fast a job's metrics reach JetStream, and how fast a run is read back and plotted.

    python -m bench.runs [--points 100000] [--repeats 3] [--ranks 8] [--rank-points 100000]
                         [--read 1000000] [--peer-read 100000] [--quick]

Everything runs against a nats-server of the benchmark's own, with `sync_interval: always` as deploy/
runs it, and the `TRAINYARD_METRICS` stream as the monitor declares it. This process plays the node's
agent: a `RunRelay` per rank (agent/output/runs.py), each publishing its batches as agent/output/shipper.py does (on the
job's metrics subject, with a Nats-Msg-Id). Each rank is a process of its own that imports only what a job
imports and logs with `trainyard.run`.

1. One process: POINTS calls of `run.log({"loss": x}, step=i)`, then `run.flush()`: the time of each
   `log()` call in the caller's thread (mean, percentiles, longest), points per second until the agent has them all, and
   the same POINTS calls of tensorboardX's `SummaryWriter.add_scalar` in the same process (the two in
   alternating order, REPEATS processes; medians).
2. RANKS processes at once, one per rank, each through its own relay into one job's subject, each
   logging RANK_POINTS points: points per second from the first `log()` to the last batch stored
   (acknowledged by JetStream). The stream is then read back: every process's points, each once.
3. READ points of one series stored as an agent stores them (batches of 1,000 points), read through the
   monitor's `RunReader.series` page after page as the client asks for them (following `next_after` while
   `more`), then plotted with plotext (the plot built as text, not printed) and with matplotlib (Agg, a
   PNG), every point; then as `trainyard metrics JOB loss --plot` / `--png` draw them (client/plots.py,
   which thins a line first). PEER_READ points written by tensorboardX and read by TensorBoard's
   `EventAccumulator` give the peer's reading rate.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import matplotlib
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from agent.output.runs import RunRelay, remove_run_folder, socket_path
from client.plots import chart_title, lines_of, png_chart, terminal_chart
from devstack.servers import free_port, start_nats
from libs.contracts import subjects
from libs.contracts.codec import decode, encode
from libs.contracts.events import EventEnvelope, JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.operations.runs import MAX_SERIES_PAGE, GetRun, GetSeries, RunView, SeriesPage, SeriesPoint
from libs.contracts.runs import MAX_POINTS_PER_BATCH, MetricBatch, MetricPoint
from libs.jobstatus import JobLifecycle
from libs.messaging.connection import STREAMS
from libs.natsroles import DURABLE_JETSTREAM
from services.monitor.runs.reader import RunReader

ROOT = Path(__file__).resolve().parent.parent
CREATOR = Identity(user="bench")
NODE = "node-bench"  # the node whose agent the benchmark plays
ONE_PROCESS_JOB, RANKS_JOB, READ_JOB = "job-be0c00000001", "job-be0c00000002", "job-be0c00000003"
SERIES = "loss"


# --- the job's side: a process of its own, as a rank is ---------------------------------------------------


# What each rank's process runs: a job's imports only (trainyard.run, and tensorboardX for the peer), so that
# its heap, and the collector's pauses in it, are a small job's. It prints "ready", waits for a line, logs,
# and prints what it measured: when it began, ended its loop and had everything taken, and each call's ns.
JOB_SCRIPT = r"""
import json, sys, time
from trainyard.run import Run

spec = json.loads(sys.argv[1])
if spec.get("tensorboard"):
    from tensorboardX import SummaryWriter  # imported before the clock starts, as a job would


def timed(log, points):
    values = [1.0 / (step + 1) for step in range(points)]
    took = [0] * points
    clock = time.perf_counter_ns
    began = time.time()
    for step, value in enumerate(values):
        start = clock()
        log(step, value)
        took[step] = clock() - start
    return {"began": began, "looped": time.time(), "took": took}


def with_trainyard():
    run = Run(path=spec["socket"], process=spec["process"])
    found = timed(lambda step, value: run.log({"loss": value}, step=step), spec["points"])
    found["taken"] = run.flush(timeout=max(60.0, spec["points"] / 1000))
    found["flushed"] = time.time()
    run.close()
    return found | {"dropped": run.dropped}


def with_tensorboardx():
    writer = SummaryWriter(logdir=spec["tensorboard"])
    found = timed(lambda step, value: writer.add_scalar("loss", value, step), spec["points"])
    writer.flush()
    found["flushed"] = time.time()
    writer.close()
    return found


print("ready", flush=True)
sys.stdin.readline()
found = {}
for what in ["trainyard", "tensorboardx"] if spec.get("trainyard_first", True) else ["tensorboardx", "trainyard"]:
    if what == "trainyard":
        found[what] = with_trainyard()
    elif spec.get("tensorboard"):
        found[what] = with_tensorboardx()
print("result " + json.dumps(found), flush=True)
"""


def call_figures(took: list[int]) -> dict[str, float]:
    """Mean, percentiles and the longest of the calls' times, in µs."""
    ordered = sorted(took)

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, int(len(ordered) * share))] / 1000

    return {"mean_us": statistics.fmean(took) / 1000, "p50_us": at(0.5), "p99_us": at(0.99), "p999_us": at(0.999),
            "max_us": ordered[-1] / 1000}


# --- the agent's side -------------------------------------------------------------------------------------


@dataclass
class Agent:
    """A node's agent as far as runs go: a relay per rank, publishing as agent/output/shipper.py publishes."""

    js: JetStreamContext
    folder: Path
    relays: list[tuple[RunRelay, Path]] = field(default_factory=list)
    batches: int = 0
    points: int = 0
    last_stored: float = 0.0  # when JetStream acknowledged the last batch

    async def publish(self, batch: MetricBatch, msg_id: str) -> None:
        await self.js.publish(subjects.job_metrics(batch.job_id, batch.node), encode(batch),
                              headers={"Nats-Msg-Id": msg_id})
        self.batches += 1
        self.points += len(batch.points)
        self.last_stored = time.time()

    async def relay(self, job_id: str, rank: int) -> RunRelay:
        rank_folder = self.folder / f"{job_id}-{rank}"
        relay = RunRelay(job_id=job_id, attempt=1, task=0, rank=rank, node=NODE,
                         path=socket_path(rank_folder), publish=self.publish)
        await relay.start()
        self.relays.append((relay, rank_folder))
        return relay

    async def close(self) -> None:
        for relay, rank_folder in self.relays:
            await relay.close()
            remove_run_folder(rank_folder)
        self.relays.clear()


class Rank:
    """A job process on its rank's socket: started, told to go, and what it measured."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> Rank:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_RUN_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", JOB_SCRIPT, json.dumps(spec), cwd=ROOT, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 * 1024**2)  # a time per call
        rank = cls(process)
        await rank._line("ready")
        return rank

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")

    async def result(self) -> dict[str, Any]:
        """What the process measured, by what it logged with ("trainyard", "tensorboardx"), its calls' times
        summed up."""
        found: dict[str, Any] = json.loads((await self._line("result "))[len("result "):])
        await self.process.wait()
        for measured in found.values():
            measured.update(call_figures(measured.pop("took")))
        return found

    async def _line(self, prefix: str) -> str:
        assert self.process.stdout is not None
        while line := (await self.process.stdout.readline()).decode():
            if line.startswith(prefix):
                return line.strip()
        raise RuntimeError(f"a rank's process ended (exit code {await self.process.wait()}) before '{prefix}'")


# --- reading the stream back ------------------------------------------------------------------------------


async def stored_points(js: JetStreamContext, job_id: str) -> dict[tuple[int, str], list[int]]:
    """Every point's line number in the job's stored batches, by rank and process, as stored (repeats kept)."""
    found: dict[tuple[int, str], list[int]] = {}
    subject = subjects.metrics_of_job(job_id)
    after = 0
    while True:
        try:
            msg = await js.get_msg(subjects.METRICS_STREAM, seq=after + 1, subject=subject, next=True)
        except NotFoundError:
            return found
        after = msg.seq or after + 1
        batch = decode(msg.data or b"", MetricBatch)
        found.setdefault((batch.rank, batch.process), []).extend(point.seq for point in batch.points)


def check_once(stored: dict[tuple[int, str], list[int]], processes: int, points: int) -> str | None:
    """What is wrong with what was stored, if anything: each process's points 1..POINTS, each once."""
    if len(stored) != processes:
        return f"{len(stored)} processes stored, not {processes}"
    for (rank, process), seqs in sorted(stored.items()):
        if seqs != list(range(1, points + 1)):
            missing = points - len(set(seqs))
            return f"rank {rank} {process}: {len(seqs)} points stored, {missing} missing, " \
                   f"{len(seqs) - len(set(seqs))} twice"
    return None


def lifecycle_with(*job_ids: str) -> JobLifecycle:
    """The monitor's view of the scheduler's jobs: each submitted by CREATOR, so CREATOR may read its run."""
    jobs = JobLifecycle()
    spec = JobSpec(name="bench", flavors=["cpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
                   output=OutputRef(name="o"))
    for number, job_id in enumerate(job_ids, 1):
        jobs.apply(EventEnvelope(event_id=f"bench-{number}", service="scheduler", aggregate_type="job",
                                 aggregate_id=job_id, version=1, position=number, recorded_at=datetime.now(UTC),
                                 event=JobSubmitted(job_id=job_id, spec=spec, creator=CREATOR.user)))
        jobs.jobs[job_id].nodes_used[NODE] = None  # the node the relays publish as
    return jobs


async def run_counts(reader: RunReader, job_id: str) -> dict[int, int]:
    """Points of the series per rank, as the monitor's `trainyard metrics JOB` reads them."""
    view = await reader.run(GetRun(job_id=job_id), CREATOR)
    if not isinstance(view, RunView):
        raise RuntimeError(f"the run was not read: {view}")
    return {series.rank: series.count for series in view.series if series.name == SERIES}


# --- the parts --------------------------------------------------------------------------------------------


@dataclass
class Figures:
    rows: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # points lost or stored twice: the run fails
    notes: list[str] = field(default_factory=list)  # limits the figures ran into

    def add(self, measure: str, value: str) -> None:
        self.rows.append((measure, value))
        print(f"  {measure}: {value}", flush=True)


def median(found: list[dict[str, Any]], what: str, key: str) -> float:
    return float(statistics.median(one[what][key] for one in found))


async def one_process(js: JetStreamContext, agent: Agent, reader: RunReader, args: argparse.Namespace,
                      figures: Figures, home: Path) -> None:
    relay = await agent.relay(ONE_PROCESS_JOB, 0)
    found: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        rank = await Rank.start({"socket": str(relay.path), "process": f"repeat-{repeat}", "points": args.points,
                                 "tensorboard": str(home / f"tensorboard-{repeat}"),
                                 "trainyard_first": repeat % 2 == 0})
        rank.go()
        found.append(await rank.result())
        ours, theirs = found[-1]["trainyard"], found[-1]["tensorboardx"]
        print(f"  repeat {repeat + 1}: log() {ours['mean_us']:.2f} µs, add_scalar {theirs['mean_us']:.2f} µs, "
              f"{args.points / (ours['flushed'] - ours['began']):,.0f} points/s to JetStream", flush=True)
    ours = [one["trainyard"] for one in found]
    if not all(one["taken"] and not one["dropped"] for one in ours):
        figures.problems.append(f"one process: run.flush() and run.dropped of each process: "
                                f"{[(o['taken'], o['dropped']) for o in ours]}")
    stored = await stored_points(js, ONE_PROCESS_JOB)
    if (wrong := check_once(stored, args.repeats, args.points)) is not None:
        figures.problems.append(f"one process: {wrong}")
    counts = await run_counts(reader, ONE_PROCESS_JOB)
    if counts != {0: args.repeats * args.points}:
        figures.problems.append(f"one process: RunReader.run counted {counts}")

    mean, theirs = median(found, "trainyard", "mean_us"), median(found, "tensorboardx", "mean_us")
    for label, what in (("log()", "trainyard"), ("tensorboardX add_scalar", "tensorboardx")):
        figures.add(f"one process: {label} per call, mean / p50 / p99 / p99.9 / max",
                    " / ".join(f"{median(found, what, key):,.1f}"
                               for key in ("mean_us", "p50_us", "p99_us", "p999_us", "max_us")) + " µs")
    figures.add("one process: log() / add_scalar, mean per call", f"{mean / theirs:.2f}")
    loop = statistics.median(args.points / (o["looped"] - o["began"]) for o in ours)
    sustained = statistics.median(args.points / (o["flushed"] - o["began"]) for o in ours)
    to_disk = statistics.median(args.points / (o["tensorboardx"]["flushed"] - o["tensorboardx"]["began"])
                                for o in found)
    figures.add("one process: log() loop alone", f"{loop:,.0f} points/s")
    figures.add("one process: logged and stored in JetStream (log() loop + flush())", f"{sustained:,.0f} points/s")
    figures.add("one process: tensorboardX, logged and written (add_scalar loop + flush())",
                f"{to_disk:,.0f} points/s")
    if not figures.problems:
        figures.add("one process: checked", f"{args.repeats} × {args.points:,} points stored, each once")


async def many_ranks(js: JetStreamContext, agent: Agent, reader: RunReader, args: argparse.Namespace,
                     figures: Figures) -> None:
    relays = [await agent.relay(RANKS_JOB, rank) for rank in range(args.ranks)]
    ranks = [await Rank.start({"socket": str(relay.path), "process": "main", "points": args.rank_points})
             for relay in relays]
    print(f"  {args.ranks} processes ready, logging", flush=True)
    before_batches, before_points = agent.batches, agent.points
    for rank in ranks:
        rank.go()
    found = [(await rank.result())["trainyard"] for rank in ranks]
    if not all(one["taken"] and not one["dropped"] for one in found):
        figures.problems.append(f"{args.ranks} ranks: run.flush() and run.dropped of each rank: "
                                f"{[(o['taken'], o['dropped']) for o in found]}")
    began = min(one["began"] for one in found)
    elapsed = agent.last_stored - began
    stored = await stored_points(js, RANKS_JOB)
    if (wrong := check_once(stored, args.ranks, args.rank_points)) is not None:
        figures.problems.append(f"{args.ranks} ranks: {wrong}")
    counts = await run_counts(reader, RANKS_JOB)
    if counts != {rank: args.rank_points for rank in range(args.ranks)}:
        figures.problems.append(f"{args.ranks} ranks: RunReader.run counted {counts}")
    batches = agent.batches - before_batches
    kept = sum(len(seqs) for seqs in stored.values())
    figures.add(f"{args.ranks} ranks: first log() to last point stored",
                f"{kept:,} points in {elapsed:.2f} s, {kept / elapsed:,.0f} points/s "
                f"({batches:,} batches, {(agent.points - before_points) / batches:,.0f} points each)")
    figures.add(f"{args.ranks} ranks: log() per call, mean / p50 / p99 / p99.9 / max (median of the ranks)",
                " / ".join(f"{statistics.median(o[key] for o in found):,.1f}"
                           for key in ("mean_us", "p50_us", "p99_us", "p999_us", "max_us")) + " µs")
    figures.add(f"{args.ranks} ranks: slowest rank's log() loop",
                f"{max(o['looped'] - o['began'] for o in found):.2f} s")
    if not figures.problems:
        figures.add(f"{args.ranks} ranks: checked", f"{args.ranks} × {args.rank_points:,} points stored, each once; "
                                                   "RunReader.run counts the same")


async def store_series(agent: Agent, points: int) -> float:
    """POINTS points of one series of rank 0, published in batches as an agent publishes them; the seconds."""
    at = datetime.now(UTC)
    began = time.perf_counter()
    for first in range(1, points + 1, MAX_POINTS_PER_BATCH):
        last = min(points, first + MAX_POINTS_PER_BATCH - 1)
        batch = MetricBatch(job_id=READ_JOB, attempt=1, task=0, rank=0, node=NODE, process="main",
                            points=[MetricPoint(seq=seq, name=SERIES, value=1.0 / seq,
                                                at=at + timedelta(milliseconds=seq), step=seq - 1)
                                    for seq in range(first, last + 1)])
        await agent.publish(batch, f"{READ_JOB}.1.0.0.main.{first}-{last}")
    return time.perf_counter() - began


async def read_series(reader: RunReader, limit: int | None) -> tuple[float, list[SeriesPoint], list[SeriesPage]]:
    """Every point of the series, page after page as the client asks for them; the seconds, points, pages."""
    points: list[SeriesPoint] = []
    pages: list[SeriesPage] = []
    after = 0
    began = time.perf_counter()
    while True:
        request = GetSeries(job_id=READ_JOB, name=SERIES, rank=0, after=after)
        if limit is not None:
            request = GetSeries(job_id=READ_JOB, name=SERIES, rank=0, after=after, limit=limit)
        page = await reader.series(request, CREATOR)
        if not isinstance(page, SeriesPage):
            raise RuntimeError(f"the series was not read: {page}")
        pages.append(page)
        points += page.points
        after = page.next_after
        if not page.more:
            return time.perf_counter() - began, points, pages


def codec_seconds(pages: list[SeriesPage]) -> tuple[float, int]:
    """What the pages cost on the wire as replies: encoding and decoding them all; the largest page's bytes."""
    largest = 0
    began = time.perf_counter()
    for page in pages:
        raw = encode(page)
        largest = max(largest, len(raw))
        decode(raw, SeriesPage)
    return time.perf_counter() - began, largest


def plot_with_plotext(points: list[SeriesPoint]) -> tuple[float, int]:
    plt = importlib.import_module("plotext")
    began = time.perf_counter()
    plt.clear_figure()
    plt.plot([p.step or 0 for p in points], [p.value for p in points])
    plt.plotsize(120, 30)
    text = plt.build()
    return time.perf_counter() - began, len(text)


def plot_with_matplotlib(points: list[SeriesPoint], png: Path) -> tuple[float, int]:
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    began = time.perf_counter()
    figure = Figure(figsize=(10, 4), dpi=100)
    figure.add_subplot().plot([p.step or 0 for p in points], [p.value for p in points])
    figure.savefig(png)
    return time.perf_counter() - began, png.stat().st_size


def plot_as_the_client(points: list[SeriesPoint], png: Path) -> tuple[float, float]:
    """`trainyard metrics JOB loss --plot` and `--png`: the client's charts (thinned first); seconds each."""
    began = time.perf_counter()
    lines = lines_of(points)
    terminal_chart(lines, chart_title(READ_JOB, SERIES, list(lines)), width=120, height=30)
    terminal = time.perf_counter() - began
    began = time.perf_counter()
    lines = lines_of(points)
    png_chart(lines, chart_title(READ_JOB, SERIES, list(lines)), png)
    return terminal, time.perf_counter() - began


def read_with_tensorboard(folder: Path, points: int) -> tuple[float, float]:
    """PEER_READ points written by tensorboardX and read back by TensorBoard's EventAccumulator: seconds each."""
    writer = importlib.import_module("tensorboardX").SummaryWriter(logdir=str(folder))
    began = time.perf_counter()
    for step in range(points):
        writer.add_scalar(SERIES, 1.0 / (step + 1), step)
    writer.close()
    written = time.perf_counter() - began
    accumulator = importlib.import_module("tensorboard.backend.event_processing.event_accumulator")
    began = time.perf_counter()
    events = accumulator.EventAccumulator(str(folder), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    scalars = events.Scalars(SERIES)
    read = time.perf_counter() - began
    if len(scalars) != points:
        raise RuntimeError(f"TensorBoard read {len(scalars)} points, not {points}")
    return written, read


async def read_and_plot(agent: Agent, reader: RunReader, nc: Client, args: argparse.Namespace, figures: Figures,
                        home: Path) -> None:
    stored = await store_series(agent, args.read)
    figures.add("read: stored as an agent stores them (batches of 1,000, one after the other)",
                f"{args.read:,} points in {stored:.2f} s")
    default_limit = GetSeries(job_id=READ_JOB, name=SERIES).limit
    points: list[SeriesPoint] = []
    rate = 0.0
    sizes: list[tuple[str, int | None]] = [(f"pages of {default_limit:,} (the client's request)", None)]
    if default_limit != MAX_SERIES_PAGE:
        sizes.append((f"pages of {MAX_SERIES_PAGE:,} (MAX_SERIES_PAGE)", MAX_SERIES_PAGE))
    for label, limit in sizes:
        seconds, points, pages = await read_series(reader, limit)
        seqs = [p.seq for p in points]
        if len(points) != args.read or (any(seqs) and seqs != list(range(1, args.read + 1))):
            figures.problems.append(f"read, {label}: {len(points):,} points read, not {args.read:,} each once")
        rate = rate or len(points) / seconds
        figures.add(f"read: RunReader.series, {label}",
                    f"{seconds:.2f} s, {len(points) / seconds:,.0f} points/s, {len(pages)} pages")
        codec, largest = codec_seconds(pages)
        figures.add(f"read: those pages encoded and decoded as replies, {label}",
                    f"{codec:.2f} s; largest {largest:,} bytes (the server's max payload: {nc.max_payload:,})")
        if largest > nc.max_payload:
            figures.notes.append(f"read, {label}: a page encodes to {largest:,} bytes, more than the server's "
                                 f"max payload ({nc.max_payload:,}): as a reply it would be refused")
    print(f"  plotting {len(points):,} points", flush=True)
    took, size = plot_with_plotext(points)
    figures.add("plot: plotext, built as text (120 × 30)", f"{took:.2f} s ({size:,} characters)")
    took, size = plot_with_matplotlib(points, home / "series.png")
    figures.add("plot: matplotlib, Agg, to a PNG (1000 × 400)", f"{took:.2f} s ({size:,} bytes)")
    terminal, png = plot_as_the_client(points, home / "client.png")
    figures.add("plot: the client's terminal chart (`--plot`: thinned, plotext)", f"{terminal:.2f} s")
    figures.add("plot: the client's PNG chart (`--png`: thinned, matplotlib)", f"{png:.2f} s")
    if args.peer_read:
        print(f"  tensorboardX writing {args.peer_read:,} points, TensorBoard reading them", flush=True)
        written, read = read_with_tensorboard(home / "tensorboard-read", args.peer_read)
        figures.add("read: TensorBoard EventAccumulator (tensorboardX's event file)",
                    f"{args.peer_read:,} points in {read:.2f} s, {args.peer_read / read:,.0f} points/s "
                    f"(written in {written:.2f} s)")
        figures.add("read: RunReader.series / EventAccumulator, points per second",
                    f"{rate / (args.peer_read / read):.2f}")


async def measure(args: argparse.Namespace) -> Figures:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-runs-") as folder:
        home = Path(folder)
        config = home / "nats.conf"
        config.write_text(DURABLE_JETSTREAM)
        port = free_port()
        server = start_nats(home / "nats", port, config=config)
        try:
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            js = nc.jetstream()
            [metrics] = [c for c in STREAMS if c.name == subjects.METRICS_STREAM]
            await js.add_stream(metrics)
            agent = Agent(js, home / "ranks")
            reader = RunReader(js, lifecycle_with(ONE_PROCESS_JOB, RANKS_JOB, READ_JOB), {})
            try:
                if args.points:
                    print(f"\n1. one process, {args.points:,} points, {args.repeats} processes", flush=True)
                    await one_process(js, agent, reader, args, figures, home)
                if args.ranks:
                    print(f"\n2. {args.ranks} ranks at once, {args.rank_points:,} points each", flush=True)
                    await many_ranks(js, agent, reader, args, figures)
                await agent.close()
                if args.read:
                    print(f"\n3. {args.read:,} points of one series read and plotted", flush=True)
                    await read_and_plot(agent, reader, nc, args, figures, home)
            finally:
                await agent.close()
                await nc.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runs", description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000, help="part 1: points one process logs")
    parser.add_argument("--repeats", type=int, default=3, help="part 1: processes, one after the other")
    parser.add_argument("--ranks", type=int, default=8, help="part 2: processes logging at once (0: skip)")
    parser.add_argument("--rank-points", type=int, default=100_000, help="part 2: points each rank logs")
    parser.add_argument("--read", type=int, default=1_000_000, help="part 3: points of the series read (0: skip)")
    parser.add_argument("--peer-read", type=int, default=100_000,
                        help="part 3: points TensorBoard reads (0: skip)")
    parser.add_argument("--quick", action="store_true", help="small sizes, to see that it works")
    args = parser.parse_args()
    if args.quick:
        args.points, args.repeats, args.ranks, args.rank_points = 2000, 2, 2, 2000
        args.read, args.peer_read = 20_000, 2000
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}")
    figures = asyncio.run(measure(args))
    width = max(len(label) for label, _ in figures.rows)
    print(f"\n{'measure':<{width}}  value")
    for label, value in figures.rows:
        print(f"{label:<{width}}  {value}")
    for note in figures.notes:
        print(f"NOTE: {note}")
    for problem in figures.problems:
        print(f"PROBLEM: {problem}")
    if figures.problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
