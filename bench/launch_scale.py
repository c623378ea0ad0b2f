"""Launch scale: how long a job of N nodes takes from its admission to every rank started, in each distributed mode.

    python -m bench.launch_scale [--nodes 64,256,1024] [--modes pytorch,pytorch-deepspeed,horovod,tensorflow]
                                 [--repeat 3] [--per-connection 500] [--timeout 600]

One stack of the four real services (no real agent) on the tests' NATS and PostgreSQL, with as many simulated nodes
as the largest count (bench/simnodes.py: each registers with its own node credential and heartbeats), and simulated
agents answering the launcher's ports, start and stop requests (bench/simagents.py: a started process runs until it
is stopped). For each mode and node count, one job of that many nodes, of a flavor each node fits once (so the job
takes N nodes), is submitted; once every rank started it is stopped, and the next starts once it is `stopped`. Each
is done `--repeat` times; the table gives the medians (a launch of 64 nodes takes a tenth of a second or two: one
run's figure says little).

Measured from the job's events (the client's `events`): submit -> admitted (JobSubmitted to JobAdmitted), and the
launch: from JobAdmitted to the last NodeProcessStarted of the attempt, split into planning (to LaunchPlanned),
sending (to the last start the simulated agents answered) and recording (to the last NodeProcessStarted); then the
stop: from the request to the last stop the simulated agents answered, and to the job seen `stopped` by the client
(which looks every 0.2 s). A launch whose cost per node grows with the node count grows
faster than linearly: the report gives, per mode, the cost of each node added between two counts, and that between
the largest counts over that between the smallest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.servers import bench_servers
from bench.simagents import SimulatedAgents
from bench.simnodes import HEARTBEAT_SECONDS, Fleet, simulated_nodes
from client.api import NoAnswer, TrainyardClient, TrainyardError
from devstack.harness import FAST_TIMINGS, Stack
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobSubmitted,
    LaunchPlanned,
    NodeProcessStarted,
)
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, Mode, OutputRef
from libs.contracts.operations.jobs import JobView

MODES: tuple[Mode, ...] = ("pytorch", "pytorch-deepspeed", "horovod", "tensorflow")
FLAVOR = "whole-node"  # fits a simulated node (bench/simnodes.py: 16 CPUs, 64 GiB) once
CLUSTER = f"""flavors:
  - {{name: {FLAVOR}, cpus: 12, memory_mib: 49152}}
nodes: []
"""
PROCESS_SECONDS = 24 * 3600.0  # a simulated process runs until it is stopped
ENDED = ("succeeded", "failed", "stopped", "expired")
LINEAR_SLACK = 1.25  # a node added costing up to this much more at the larger counts still counts as linear


def large_spec(mode: Mode, nodes: int, name: str, *, pool: str | None = None,
               checkpoint_resume: CheckpointResume | None = None) -> JobSpec:
    """A job of `nodes` whole nodes in `mode` (the simulated agents run nothing of it)."""
    return JobSpec(name=name, mode=mode, nodes=nodes, flavors=[FLAVOR], algorithm=AlgorithmRef(name="pytorch-ddp"),
                   command="python3 train.py --epochs 1", output=OutputRef(name=name), pool=pool,
                   checkpoint_resume=checkpoint_resume)


def timings(*, heartbeat_seconds: float, lost_seconds: float) -> dict[str, str]:
    """The stack's fault timings: the tests' fast ones, with the heartbeat and the loss of a node as given."""
    return {**FAST_TIMINGS, "TRAINYARD_HEARTBEAT_SECONDS": f"{heartbeat_seconds:g}",
            "TRAINYARD_NODE_LOST_SECONDS": f"{lost_seconds:g}"}


@dataclass
class SimulatedStack:
    """The services, the simulated nodes registered and heartbeating, and their agents."""

    stack: Stack[TrainyardClient]
    api: TrainyardClient
    fleet: Fleet
    agents: SimulatedAgents


async def every_service_answers(api: TrainyardClient, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while True:  # the autoscaler is the one the others do not wait for
            with contextlib.suppress(NoAnswer):
                await api.queue_status()
                await api.list_jobs()
                return
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def simulated_stack(home: Path, nats_url: str, database_url: str, nodes: int, *,
                          heartbeat_seconds: float = HEARTBEAT_SECONDS, lost_seconds: float = 10.0,
                          pools: Sequence[str] = (), per_connection: int = 500,
                          say: Callable[[str], None] = lambda _: None) -> AsyncIterator[SimulatedStack]:
    """A stack of the real services under `home` on a NATS server without role enforcement, with `nodes` simulated
    nodes (in `pools`) ready and their simulated agents answering, until the block ends."""
    home.mkdir(parents=True, exist_ok=True)
    cluster = home / "cluster.yaml"
    cluster.write_text(CLUSTER)
    stack = Stack(home / "stack", nats_url, database_url, connect=TrainyardClient.open, cluster=cluster,
                  timings=timings(heartbeat_seconds=heartbeat_seconds, lost_seconds=lost_seconds))
    try:
        began = time.monotonic()
        stack.start_all(agents=False)
        api = await stack.api(timeout=60)
        await every_service_answers(api)
        say(f"services up in {time.monotonic() - began:.1f} s")
        secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"]).read_text().strip()
        async with simulated_nodes(nats_url, secret, nodes, per_connection=per_connection,
                                   heartbeat_seconds=heartbeat_seconds, pools=pools) as fleet:
            agents = SimulatedAgents(fleet.connections[0].jetstream(), seconds=PROCESS_SECONDS)
            try:
                for nc in fleet.connections:
                    await agents.serve(nc)
                await stack.wait_for_nodes(count=nodes, timeout=60 + nodes / 20)
                say(f"{nodes} simulated nodes registered in {fleet.registered_seconds:.1f} s, ready after "
                    f"{time.monotonic() - began:.1f} s")
                yield SimulatedStack(stack, api, fleet, agents)
            finally:
                await agents.close()
    finally:
        await stack.close()


# --- one job's launch, from its events -----------------------------------------------------------------


@dataclass(frozen=True)
class Launched:
    """What the events of one attempt tell of its launch."""

    attempt: int
    submitted: datetime
    admitted: datetime
    placement: dict[int, str]  # rank -> node, as admitted
    started: dict[int, str]  # rank -> node, of every NodeProcessStarted of the attempt
    last_started: datetime | None
    planned: datetime | None  # LaunchPlanned

    @property
    def admission_seconds(self) -> float:
        return (self.admitted - self.submitted).total_seconds()

    @property
    def launch_seconds(self) -> float:
        return (self.last_started - self.admitted).total_seconds() if self.last_started else float("nan")


def launched(events: Sequence[EventEnvelope], attempt: int) -> Launched:
    """The launch of `attempt` in a job's events (its JobAdmitted must be there)."""
    submitted = next(e.recorded_at for e in events if isinstance(e.event, JobSubmitted))
    admission = next(e for e in events if isinstance(e.event, JobAdmitted) and e.event.attempt == attempt)
    assert isinstance(admission.event, JobAdmitted)
    starts = [e for e in events if isinstance(e.event, NodeProcessStarted) and e.event.attempt == attempt]
    started = {e.event.rank: e.event.node for e in starts if isinstance(e.event, NodeProcessStarted)}
    planned = next((e.recorded_at for e in events if isinstance(e.event, LaunchPlanned) and e.event.attempt == attempt),
                   None)
    return Launched(attempt=attempt, submitted=submitted, admitted=admission.recorded_at,
                    placement={p.rank: p.node for p in admission.event.placement}, started=started,
                    last_started=max((e.recorded_at for e in starts), default=None), planned=planned)


async def wait_status(api: TrainyardClient, job_id: str, done: Callable[[JobView], bool], timeout: float,
                      progress: Callable[[float, JobView], None] | None = None, every: float = 0.5) -> JobView:
    """Poll the job until `done` (or it ended); `progress` is told every 5 s meanwhile."""
    began = shown = time.monotonic()
    async with asyncio.timeout(timeout):
        while True:
            job = (await api.get_job(job_id)).job
            if done(job) or job.status in ENDED:
                return job
            if progress is not None and time.monotonic() - shown >= 5:
                shown = time.monotonic()
                progress(shown - began, job)
            await asyncio.sleep(every)


def all_running(attempt: int) -> Callable[[JobView], bool]:
    """Whether the job's `attempt` runs with every instance started."""
    def done(job: JobView) -> bool:
        return (job.attempt == attempt and job.status == "running" and bool(job.instances)
                and all(i.state == "running" for i in job.instances))
    return done


async def events_of(api: TrainyardClient, job_id: str, attempt: int, ranks: int, timeout: float = 60) -> list[
        EventEnvelope]:
    """The job's events once they hold every rank's start of `attempt` (the launcher's events reach the history as
    they are published)."""
    async with asyncio.timeout(timeout):
        while True:
            events = await api.events(job_id)
            if sum(isinstance(e.event, NodeProcessStarted) and e.event.attempt == attempt for e in events) >= ranks:
                return events
            await asyncio.sleep(0.5)


# --- the benchmark -------------------------------------------------------------------------------------


@dataclass
class Row:
    mode: str
    nodes: int
    note: str = ""  # why there are no figures (refused, failed, timed out)
    figures: dict[str, float] = field(default_factory=dict)


async def one_job(sim: SimulatedStack, mode: Mode, nodes: int, timeout: float) -> Row:
    api, agents = sim.api, sim.agents
    row = Row(mode, nodes)
    label = f"  {mode} x {nodes}"
    try:
        accepted = await api.submit(large_spec(mode, nodes, f"scale-{mode}-{nodes}"))
    except TrainyardError as exc:
        row.note = f"refused: {exc}"
        print(f"{label}: {row.note}", flush=True)
        return row
    job_id = accepted.job_id

    def progress(seconds: float, job: JobView) -> None:
        counts = {kind: (found.count if (found := agents.answered.get((kind, job_id, 1))) else 0)
                  for kind in ("ports", "start", "started")}
        print(f"{label}: {seconds:5.0f} s {job.status}, ports answered {counts['ports']}, starts answered "
              f"{counts['start']}/{nodes}, started reported {counts['started']}", flush=True)

    try:
        job = await wait_status(api, job_id, all_running(1), timeout, progress)
        if job.status in ENDED:
            row.note = f"{job.status}: {job.reason}"
            print(f"{label}: {row.note}", flush=True)
            return row
    except TimeoutError:
        row.note = f"not every rank started within {timeout:.0f} s"
    if not row.note:
        try:
            events = await events_of(api, job_id, 1, nodes)
        except TrainyardError as exc:
            row.note = f"its events cannot be read: {exc}"
            print(f"{label}: {row.note}", flush=True)
    if not row.note:
        seen = launched(events, 1)
        start = agents.answered[("start", job_id, 1)]
        row.figures = {
            "submit_to_admitted_s": seen.admission_seconds,
            "launch_s": seen.launch_seconds,
            "per_node_ms": seen.launch_seconds / nodes * 1000,
            "plan_s": (seen.planned - seen.admitted).total_seconds() if seen.planned else float("nan"),
            "send_s": (start.last - (seen.planned or seen.admitted)).total_seconds(),
            "record_s": (seen.last_started - start.last).total_seconds() if seen.last_started else float("nan"),
        }
        print(f"{label}: admitted {seen.admission_seconds:.2f} s after its submit, every rank started "
              f"{seen.launch_seconds:.2f} s after its admission ({row.figures['per_node_ms']:.1f} ms a node: "
              f"plan {row.figures['plan_s']:.2f} s, send {row.figures['send_s']:.2f} s, "
              f"record {row.figures['record_s']:.2f} s)", flush=True)
    stopping, asked = time.monotonic(), datetime.now(UTC)
    await api.stop([job_id])
    ended = await wait_status(api, job_id, lambda job: False, timeout,
                              lambda seconds, job: print(f"{label}: stopping for {seconds:.0f} s", flush=True),
                              every=0.2)
    row.figures["stop_s"] = time.monotonic() - stopping
    stops = agents.answered.get(("stop", job_id, 1))
    if stops is not None:
        row.figures["stops_answered_s"] = (stops.last - asked).total_seconds()
    print(f"{label}: {ended.status} {row.figures['stop_s']:.1f} s after the stop request (seen every 0.2 s), the "
          f"last of the stops answered on {len(stops.nodes) if stops else 0} nodes after "
          f"{row.figures.get('stops_answered_s', float('nan')):.2f} s", flush=True)
    return row


def median_row(runs: list[Row]) -> Row:
    """The median of each figure over the runs that have it (the first run's note when none has figures)."""
    measured = [run for run in runs if "launch_s" in run.figures]
    if not measured:
        return runs[0]
    keys = dict.fromkeys(key for run in measured for key in run.figures)
    return Row(runs[0].mode, runs[0].nodes, figures={
        key: statistics.median(run.figures[key] for run in measured if key in run.figures) for key in keys})


def report(rows: list[Row], counts: list[int]) -> None:
    columns = ("launch_s", "per_node_ms", "submit_to_admitted_s", "plan_s", "send_s", "record_s",
               "stops_answered_s", "stop_s")
    widths = [max(10, len(c) + 2) for c in columns]
    print(f"\n{'mode':<19}{'nodes':>7}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        if row.note and not row.figures.get("launch_s"):
            print(f"{row.mode:<19}{row.nodes:>7}   {row.note[:150]}")
            continue
        print(f"{row.mode:<19}{row.nodes:>7}" + "".join(f"{row.figures.get(c, float('nan')):>{w}.2f}"
                                                        for c, w in zip(columns, widths, strict=True)))
    if len(set(counts)) < 2:
        return
    print()
    for mode in dict.fromkeys(row.mode for row in rows):
        measured = {row.nodes: row.figures for row in rows if row.mode == mode and "launch_s" in row.figures}
        sizes = sorted(measured)
        steps = list(itertools.pairwise(sizes))
        added = [(measured[b]["launch_s"] - measured[a]["launch_s"]) / (b - a) for a, b in steps]
        marginal = ", ".join(f"{a}->{b}: {cost * 1000:.1f} ms" for (a, b), cost in zip(steps, added, strict=True))
        if len(added) >= 2:
            # Linear: each node added costs as much between the larger counts as between the smaller ones (the
            # fixed cost of a launch, which the per-node figure at a small count carries, drops out).
            ratio = added[-1] / added[0] if added[0] > 0 else float("inf")
            verdict = "grows no faster than linearly" if ratio <= LINEAR_SLACK else "grows faster than linearly"
            print(f"{mode}: cost of each node added: {marginal}: {ratio:.2f} times as much at the larger counts: "
                  f"{verdict}")
        else:
            print(f"{mode}: measured at fewer than three node counts; cost of each node added: {marginal or '-'}")


async def run(counts: list[int], modes: list[Mode], args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    async with contextlib.AsyncExitStack() as held:
        servers = await held.enter_async_context(bench_servers("launchscale"))
        sim = await held.enter_async_context(simulated_stack(
            servers.home / "run", servers.nats_url, servers.database_url, max(counts),
            per_connection=args.per_connection, say=lambda text: print(text, flush=True)))
        for mode in modes:
            for count in counts:
                runs = [await one_job(sim, mode, count, args.timeout) for _ in range(args.repeat)]
                rows.append(median_row(runs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="64,256,1024")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--per-connection", type=int, default=500, help="simulated nodes per NATS connection")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take to start or to stop")
    parser.add_argument("--repeat", type=int, default=3, help="jobs per mode and node count (the table: medians)")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.nodes.split(",")})
    known: dict[str, Mode] = {mode: mode for mode in MODES}
    if unknown := [mode for mode in args.modes.split(",") if mode not in known]:
        parser.error(f"--modes: {', '.join(unknown)}: not among {', '.join(MODES)}")
    modes = [known[mode] for mode in args.modes.split(",")]
    rows = asyncio.run(run(counts, modes, args))
    report(rows, counts)


if __name__ == "__main__":
    main()
