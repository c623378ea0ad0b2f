"""Soak: whether a control plane that runs for months holds steady as jobs keep coming and ending.

    python -m bench.soak [--jobs 1000000] [--nodes 64] [--retention 1m] [--in-flight 32] [--rate N] [--samples 20]
                         [--restarts 4] [--agent-every 10] [--keep-logs DIR] [--timeout 600]

One stack of the four real services as separate processes on NATS and PostgreSQL as the tests get them
(bench/servers.py), with `--nodes` simulated nodes (bench/simnodes.py) whose simulated agents (bench/simagents.py)
let each started process exit at once with code 0, and one real node agent process: every `--agent-every`-th job asks
for the pool only the real agent's node serves, so that it runs real processes (`true`) and its memory is measured
too (`--agent-every 0`: no real agent). The administrator's `job_retention` is set to `--retention` first, so that
ended jobs leave the services' memory (JobArchived) a minute after their end by default.

Then `--jobs` trivial single-node jobs are submitted through the Python client, `--in-flight` submissions out at a
time, without pause: a closed flow, as fast as they are answered, which speeds up whenever submissions get cheaper
(while a restarted scheduler catches up and decides nothing, say). `--rate N` makes it an open one: each job is
sent 1/N s after the one before it, not sooner (still within `--in-flight` out), as users submit whatever the
scheduler is doing; a flow the stack kept behind goes on at N a second from where it is, never faster to catch up. A
submission nothing answers (a service being restarted) is sent again with the same job id; its latency counts from
the first attempt. While they flow, `--samples` samples are taken, evenly spaced by jobs
submitted, each giving: every service's and the real agent's resident memory (VmRSS of the processes the harness
started; `*` marks a process started since the last sample), the submit latency p50/p99 of the window since the last
sample, the scheduler's cycle time p50/p99 over that window (from its `trainyard.scheduler.cycle.duration` histogram,
served in Prometheus' format: interpolated within its buckets, as Prometheus' histogram_quantile does), the jobs
ended and archived so far, the jobs the scheduler holds (submitted, not archived) and the events in each service's log
(counted in PostgreSQL). When the run started its own nats-server (no `NATS_URL` given), each sample also gives that
server's resident memory and how long JetStream takes to make a follower's consumer over the whole events stream now
(`JS ms`: an ephemeral consumer filtered on the scheduler's job events from the first message, made and deleted, as
a service's follower is at its start): both grew with every event while each event's subject named its job.

`--restarts` times during the run, evenly spaced by jobs submitted, each service in turn is stopped (SIGTERM) and
started again while the jobs keep flowing; each start is timed from the process's start to its lease taken
(`service.active`), its state rebuilt from its log (`<service>.rebuilt`) and its being ready: the scheduler deciding
again (`scheduler.caught_up`, once its followers replayed what came meanwhile), the launcher launching again (its
first LaunchPlanned, which it records only once caught up), the monitor and the autoscaler answering a query.

At the end, once every job ended, and once every job was archived too, one more sample (`end`: what the processes
keep once the jobs all left); then the samples as a table, the start-ups, and per process the growth of its memory
from the first sample after the warm-up (past 10% of the jobs, and with jobs archived: before the first archival
the state only grows) to the last. The goal: within 10%. The real agent keeps every rank that ended for an hour
(`FORGET_SECONDS`, so that a start sent again finds it known) and so grows for that long whatever else it does: its
growth is also given from the first sample an hour in, when it forgets ranks as fast as they end, which is what the
goal applies to. A process restarted in between is flagged: its last
figure is of a process that rebuilt its state from the log, not one that ran all along; its growth over its longest
stretch of samples without a restart (the first sample after a start left out) is given too. Every process serves
its metrics (libs/telemetry/metrics.py), which costs each a sample of its gauges every 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agent.ranks.runner import FORGET_SECONDS
from bench.capacity import rss_mib
from bench.launch_scale import every_service_answers, timings
from bench.servers import BenchServers, bench_servers
from bench.simagents import SimulatedAgents
from bench.simnodes import HEARTBEAT_SECONDS, simulated_nodes
from bench.throughput import NODE_CPUS, NODE_MEMORY_MIB, percentile, trivial_spec
from client.api import TrainyardClient, TrainyardError
from devstack.harness import Stack
from devstack.ops import metrics_env
from devstack.stack import SERVICES
from libs.contracts import subjects
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import JobSpec
from libs.messaging.rpc import ServiceUnavailable

OUTPUT = "soak"
REAL_NODE = "node-real"
REAL_POOL = "soak-real"  # a dedicated pool: only the real agent's node serves it, and it serves only that pool
AGENT = "agent"  # the real agent's column
LOST_SECONDS = 30.0  # a node is not counted lost while the monitor restarts
CYCLE_HISTOGRAM = "trainyard_scheduler_cycle_duration_seconds"
ENDED_EVENTS = ("JobSucceeded", "JobFailed", "JobStopped", "JobExpired")
WARM_UP_FRACTION = 0.1
GROWTH_GOAL_PERCENT = 10.0
RESUBMIT_PAUSE_SECONDS = 0.5
MAX_EXITS = 5  # a process that ends on its own more often than this ends the run
POLL_SECONDS = 0.05
READY = {"scheduler": "deciding again (scheduler.caught_up)", "launcher": "launching again (its first LaunchPlanned)",
         "monitor": "answering list-cache", "autoscaler": "answering queue-status"}


def cluster_text(real_agent: bool) -> str:
    """One flavor of one CPU; the real agent's node, when there is one, in a pool of its own."""
    node = (f"  - {{name: {REAL_NODE}, address: 127.0.0.1, cpus: {NODE_CPUS}, memory_mib: {NODE_MEMORY_MIB}, "
            f"pools: [{REAL_POOL}]}}\n") if real_agent else ""
    return f"flavors:\n  - {{name: cpu-1, cpus: 1, memory_mib: 100}}\nnodes:{'' if node else ' []'}\n{node}"


# --- pure rules: where to sample, cycle quantiles, growth ----------------------------------------------------


def evenly(jobs: int, count: int, *, last: bool) -> list[int]:
    """`count` points evenly spaced by jobs submitted: the last at `jobs` (`last`), else strictly inside the run."""
    parts = count if last else count + 1
    return [round(jobs * i / parts) for i in range(1, count + 1)]


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """The cumulative counts of histogram `name` by upper bound (+Inf included), summed over its series, from
    Prometheus' text format."""
    pattern = re.compile(rf"^{re.escape(name)}_bucket\{{([^}}]*)\}} (\S+)$", re.M)
    counts: dict[float, float] = {}
    for labels, value in pattern.findall(text):
        if (bound := re.search(r'le="([^"]+)"', labels)) is not None:
            key = float(bound.group(1))
            counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The `q` quantile of cumulative bucket counts, interpolated linearly within the bucket it falls in, as
    Prometheus' histogram_quantile does (in the +Inf bucket: the largest finite bound). None: nothing counted."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    below, counted = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return below
            if count == counted:
                return bound
            return below + (bound - below) * (rank - counted) / (count - counted)
        below, counted = bound, count
    return below


def window(after: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """What a cumulative histogram counted between two scrapes of one process."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def warm_up_index(points: Sequence[tuple[int, int]], warm_jobs: int) -> int | None:
    """Of samples given as (jobs submitted, jobs archived), the first one past `warm_jobs` with jobs archived (until
    the first archival every ended job stays: the state only grows); the first past `warm_jobs` if none archived."""
    past = [index for index, (jobs, _) in enumerate(points) if jobs >= warm_jobs]
    archiving = [index for index in past if points[index][1] > 0]
    return archiving[0] if archiving else (past[0] if past else None)


def kept_for_index(seconds: Sequence[float], warm: int, kept_seconds: float) -> int | None:
    """Of samples taken `seconds` after the first submission, the first from `warm` on taken once `kept_seconds` had
    passed: a process that keeps what ended for that long (the real agent its ended ranks) only grows until then.
    None: no such sample."""
    return next((index for index in range(warm, len(seconds)) if seconds[index] >= kept_seconds), None)


def growth_percent(first: float, last: float) -> float:
    return (last - first) / first * 100 if first > 0 else float("nan")


def steady_stretch(restarted: Sequence[bool], warm: int) -> tuple[int, int] | None:
    """The first and last index of the longest stretch of samples from `warm` on in which a process ran without
    being started again (`restarted[i]`: it was, between samples i - 1 and i), the sample just after a start left out
    as its own warm-up; the latest of equally long ones. None: no such stretch of two samples."""
    starts = [warm + restarted[warm], *(i + 1 for i in range(warm + 1, len(restarted)) if restarted[i])]
    ends = [i - 1 for i in range(warm + 1, len(restarted)) if restarted[i]] + [len(restarted) - 1]
    stretches = [(first, last) for first, last in zip(starts, ends, strict=True) if last > first]
    return max(stretches, key=lambda found: (found[1] - found[0], found[0])) if stretches else None


# --- the stack -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exit:
    """A process that ended on its own, started again as the local stack's supervisor would."""

    process: str
    jobs: int  # submitted by then
    code: int | None
    why: str  # the last line of its log


@dataclass
class SoakStack:
    """The services, the real agent (if any) and the simulated nodes with their agents; the processes that ended
    on their own."""

    stack: Stack[TrainyardClient]
    api: TrainyardClient
    agents: SimulatedAgents
    processes: dict[str, str]  # column -> the harness's name of the process
    exits: list[Exit] = field(default_factory=list)
    restarting: set[str] = field(default_factory=set)  # stopped and started by the run: not looked after here

    def pid(self, column: str) -> int | None:
        process = self.stack.processes.processes.get(self.processes[column])
        return process.pid if process is not None else None  # None: being restarted

    def log(self, service: str) -> Path:
        return self.stack.home / "logs" / f"{service}.log"

    def start_again_if_exited(self, name: str, jobs: int) -> Exit | None:
        """When process `name` ended on its own: note it, say so and start it again."""
        process = self.stack.processes.processes.get(name)
        if process is None or process.poll() is None:
            return None
        lines = self.stack.processes.log(name).rstrip().splitlines()
        ended = Exit(name, jobs, process.returncode, lines[-1][:300] if lines else "")
        self.exits.append(ended)
        if sum(e.process == name for e in self.exits) > MAX_EXITS:
            raise RuntimeError(f"{name} ended on its own more than {MAX_EXITS} times; the last time:\n"
                               f"{self.stack.processes.log(name)[-3000:]}")
        print(f"  {name} exited with {ended.code} at {jobs:,} jobs ({ended.why}): started again", flush=True)
        self.stack.start(name)
        return ended

    def look_after(self, jobs: int) -> None:
        """Start again every process that ended on its own, but those the run restarts itself."""
        for name in list(self.stack.processes.processes):
            if name not in self.restarting:
                self.start_again_if_exited(name, jobs)


@contextlib.asynccontextmanager
async def soak_stack(home: Path, servers: BenchServers, nodes: int, *, real_agent: bool,
                     timeout: float) -> AsyncIterator[SoakStack]:
    """The services under `home` with their metrics served, the real agent when asked for, and `nodes` simulated nodes
    whose processes exit at once, until the block ends."""
    home.mkdir(parents=True, exist_ok=True)
    cluster = home / "cluster.yaml"
    cluster.write_text(cluster_text(real_agent))
    stack = Stack(home / "stack", servers.nats_url, servers.database_url, connect=TrainyardClient.open,
                  cluster=cluster, timings=timings(heartbeat_seconds=HEARTBEAT_SECONDS, lost_seconds=LOST_SECONDS),
                  env=metrics_env(home / "stack"))
    try:
        began = time.monotonic()
        stack.start_all(agents=real_agent)
        api = await stack.api(timeout=60)
        await every_service_answers(api, timeout)
        async with asyncio.timeout(timeout):  # it registers the nodes
            while not await answers(api, "monitor"):
                await asyncio.sleep(POLL_SECONDS)
        print(f"services up in {time.monotonic() - began:.1f} s", flush=True)
        secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"]).read_text().strip()
        async with simulated_nodes(servers.nats_url, secret, nodes, heartbeat_seconds=HEARTBEAT_SECONDS) as fleet:
            agents = SimulatedAgents(fleet.connections[0].jetstream(), seconds=0, remember=False)
            agents.silence(REAL_NODE)  # its requests are the real agent's to answer
            try:
                for nc in fleet.connections:
                    await agents.serve(nc)
                await stack.wait_for_nodes(count=nodes + real_agent, timeout=timeout)
                processes = {service: service for service in SERVICES}
                if real_agent:
                    processes[AGENT] = f"agent-{REAL_NODE}"
                print(f"{nodes} simulated nodes{' and the real agent' if real_agent else ''} ready after "
                      f"{time.monotonic() - began:.1f} s", flush=True)
                yield SoakStack(stack, api, agents, processes)
            finally:
                await agents.close()
    finally:
        await stack.close()


# --- the flow of jobs ----------------------------------------------------------------------------------------


@dataclass
class Flow:
    """`jobs` jobs submitted by index, `in_flight` at a time, until all are; each one's latency kept until the
    window is taken."""

    api: TrainyardClient
    jobs: int
    agent_every: int
    rate: float | None = None  # jobs a second at most, each sent at its turn; None: as fast as they are answered
    submitted: int = 0
    resent: int = 0  # submissions sent again because nothing answered
    last_answer: float = field(default_factory=time.monotonic)
    _next: int = 0
    _due: float = 0.0  # when the next job may be sent (with `rate`)
    _latencies: list[float] = field(default_factory=list)

    def spec(self, index: int) -> JobSpec:
        real = self.agent_every > 0 and index % self.agent_every == 0
        return trivial_spec(index, output=OUTPUT, pool=REAL_POOL if real else None)

    async def run(self, in_flight: int) -> None:
        self._due = time.monotonic()
        await asyncio.gather(*(self._submitter() for _ in range(in_flight)))

    def take_window(self) -> list[float]:
        taken, self._latencies = self._latencies, []
        return taken

    async def _submitter(self) -> None:
        while self._next < self.jobs:
            index, job_id = self._next, new_job_id()
            self._next += 1
            if self.rate:  # at its turn, not sooner: an open flow, as users' (within `in_flight` out at a time)
                due = max(self._due, time.monotonic())
                self._due = due + 1 / self.rate
                await asyncio.sleep(due - time.monotonic())
            spec, sent = self.spec(index), time.monotonic()
            while True:
                try:
                    await self.api.submit(spec, job_id=job_id)
                    break
                except (ServiceUnavailable, TrainyardError) as exc:  # the client's own attempts all went unanswered
                    if isinstance(exc, TrainyardError) and exc.error.code != "unavailable":
                        raise
                    self.resent += 1
                    await asyncio.sleep(RESUBMIT_PAUSE_SECONDS)
            self.last_answer = time.monotonic()
            self._latencies.append(self.last_answer - sent)
            self.submitted += 1


# --- what a sample reads -------------------------------------------------------------------------------------


class EventLogs:
    """The events in each service's log, counted as they come (only rows past the last count are read), and the
    scheduler's by type."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.events: Counter[str] = Counter()  # service -> events in its log
        self.scheduler_types: Counter[str] = Counter()  # event type, without its version -> events
        self._after: dict[str, int] = dict.fromkeys(SERVICES, 0)

    async def count(self) -> None:
        connection = await asyncpg.connect(self.database_url)
        try:
            for service in SERVICES:
                rows = await connection.fetch(
                    f"SELECT type, count(*) AS events, max(position) AS last FROM {service}.events"
                    " WHERE position > $1 GROUP BY type", self._after[service])
                for row in rows:
                    self.events[service] += row["events"]
                    self._after[service] = max(self._after[service], row["last"])
                    if service == "scheduler":
                        self.scheduler_types[row["type"].partition(".")[0]] += row["events"]
        finally:
            await connection.close()

    @property
    def ended(self) -> int:
        return sum(self.scheduler_types[kind] for kind in ENDED_EVENTS)

    @property
    def archived(self) -> int:
        return self.scheduler_types["JobArchived"]

    @property
    def held(self) -> int:
        """The jobs the scheduler's state holds: submitted and not archived."""
        return self.scheduler_types["JobSubmitted"] - self.archived


def scrape(stack_home: Path, pid: int) -> str | None:
    """The metrics process `pid` serves (its target file under `stack_home/metrics`); None while it has none."""
    targets = list((stack_home / "metrics").glob(f"*-{pid}.json"))
    if not targets:
        return None
    address = json.loads(targets[0].read_text())[0]["targets"][0]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def resident_mib(pid: int | None) -> float:
    """VmRSS of `pid`; nan while there is no such process (being restarted)."""
    try:
        return rss_mib(pid) if pid is not None else float("nan")
    except OSError:
        return float("nan")


class NatsProbe:
    """The nats-server the run started (none: one given by `NATS_URL`, not measured): its resident memory, and the
    time JetStream takes to make a follower's consumer over the events stream."""

    def __init__(self, nats_url: str, data_dir: Path) -> None:
        self.nats_url = nats_url
        self.pid = server_pid(data_dir)
        self._nc: Client | None = None

    def rss(self) -> float:
        return resident_mib(self.pid) if self.pid is not None else float("nan")

    async def consumer_ms(self) -> float | None:
        if self.pid is None:
            return None
        try:
            if self._nc is None:
                self._nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1)
            js = self._nc.jetstream()
            config = ConsumerConfig(filter_subject=subjects.events_of("scheduler", "job")[0],
                                    deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, mem_storage=True,
                                    inactive_threshold=30.0)
            began = time.monotonic()
            made = await js.add_consumer(subjects.EVENTS_STREAM, config, timeout=60)
            took = (time.monotonic() - began) * 1000
            await js.delete_consumer(subjects.EVENTS_STREAM, made.name)
            return took
        except Exception as exc:  # an answer that does not come is the figure's absence, said so
            print(f"  (JetStream did not make a consumer: {exc!r})", flush=True)
            return None

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


def server_pid(data_dir: Path) -> int | None:
    """The nats-server storing under `data_dir` (started by the run), if any."""
    wanted = str(data_dir).encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"nats-server") and any(arg.startswith(wanted) for arg in argv):
                return int(cmdline.parent.name)
    return None


@dataclass(frozen=True)
class Sample:
    jobs: int  # submitted so far
    seconds: float  # since the first submission
    rss_mib: dict[str, float]  # by column; nan: the process was being restarted
    nats_mib: float  # the nats-server's (nan: not measured)
    consumer_ms: float | None  # JetStream making a follower's consumer over the events stream
    restarted: frozenset[str]  # the columns whose process is not the last sample's
    submit_ms: tuple[float, float] | None  # p50, p99 of the window; None: nothing submitted in it
    cycle_ms: tuple[float, float] | None  # p50, p99 of the window's cycles; None: none counted
    cycles: int
    ended: int
    archived: int
    held: int  # in the scheduler's state
    events: dict[str, int]  # by service


class Sampler:
    def __init__(self, soak: SoakStack, logs: EventLogs, probe: NatsProbe) -> None:
        self.soak = soak
        self.logs = logs
        self.probe = probe
        self.began = time.monotonic()
        self._pids: dict[str, int | None] = {}
        self._cycles: tuple[int, dict[float, float]] | None = None  # the scheduler's pid and its last buckets

    async def take(self, flow: Flow) -> Sample:
        latencies = flow.take_window()
        pids = {column: self.soak.pid(column) for column in self.soak.processes}
        rss = {column: resident_mib(pid) for column, pid in pids.items()}
        restarted = frozenset(column for column, pid in pids.items()
                              if column in self._pids and self._pids[column] != pid)
        self._pids = pids
        cycle_ms, cycles = await self._cycle_window(pids["scheduler"])
        await self.logs.count()
        return Sample(jobs=flow.submitted, seconds=time.monotonic() - self.began, rss_mib=rss,
                      nats_mib=self.probe.rss(), consumer_ms=await self.probe.consumer_ms(), restarted=restarted,
                      submit_ms=(percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000)
                      if latencies else None,
                      cycle_ms=cycle_ms, cycles=cycles, ended=self.logs.ended, archived=self.logs.archived,
                      held=self.logs.held, events=dict(self.logs.events))

    async def _cycle_window(self, pid: int | None) -> tuple[tuple[float, float] | None, int]:
        """The scheduler's cycle time p50/p99 (ms) since the last sample (since its start, when it restarted)."""
        text = await asyncio.to_thread(scrape, self.soak.stack.home, pid) if pid is not None else None
        if pid is None or text is None:
            return None, 0
        buckets = histogram_buckets(text, CYCLE_HISTOGRAM)
        counted = window(buckets, self._cycles[1]) if self._cycles and self._cycles[0] == pid else buckets
        self._cycles = (pid, buckets)
        p50, p99 = histogram_quantile(counted, 0.5), histogram_quantile(counted, 0.99)
        if p50 is None or p99 is None:
            return None, 0
        return (p50 * 1000, p99 * 1000), int(counted.get(float("inf"), 0))


# --- restarts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartUp:
    service: str
    jobs: int  # submitted when it was stopped
    stop_s: float  # from SIGTERM to its exit
    active_s: float | None  # from its start: its lease taken
    rebuilt_s: float | None  # its state rebuilt from its log
    rebuilt_events: int | None  # that the state holds
    ready_s: float | None  # READY
    failed_starts: int = 0  # it ended on its own while starting, and was started again (timed from its first start)


class LogTail:
    """The lines appended to a log file after `offset`."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset
        self._partial = b""

    def lines(self) -> Iterator[str]:
        with self.path.open("rb") as file:
            file.seek(self.offset)
            data = self._partial + file.read()
        self.offset += len(data) - len(self._partial)
        *complete, self._partial = data.split(b"\n")
        for line in complete:
            yield line.decode(errors="replace")


def seconds_after(line: str, started: datetime) -> tuple[float, dict[str, object]]:
    record = json.loads(line)
    return (datetime.fromisoformat(str(record["timestamp"])) - started).total_seconds(), record


async def answers(api: TrainyardClient, service: str) -> bool:
    """Whether `service` answers its query now."""
    try:
        if service == "monitor":
            await api.cache()
        else:
            await api.queue_status()
        return True
    except ServiceUnavailable:
        return False


async def restart(soak: SoakStack, service: str, jobs: int, timeout: float) -> StartUp:
    """Stop `service` (SIGTERM) and start it again; when it took its lease, rebuilt its state and was ready."""
    soak.restarting.add(service)
    try:
        return await _restart(soak, service, jobs, timeout)
    finally:
        soak.restarting.discard(service)


async def _restart(soak: SoakStack, service: str, jobs: int, timeout: float) -> StartUp:
    stack, log = soak.stack, soak.log(service)
    stopping = time.monotonic()
    await asyncio.to_thread(stack.processes.kill, service, signal.SIGTERM)  # waits for its exit
    stop_s = time.monotonic() - stopping
    tail = LogTail(log, log.stat().st_size)
    started, began = datetime.now(UTC), time.monotonic()
    stack.start(service)
    failed = 0
    marks: dict[str, float] = {}
    events: int | None = None
    looked_for = {"service.active": "active", f"{service}.rebuilt": "rebuilt", "scheduler.caught_up": "ready"}
    try:
        async with asyncio.timeout(timeout):
            while "ready" not in marks:
                for line in tail.lines():
                    name = next((event for event in looked_for if f'"{event}"' in line), None)
                    if name is None and service == "launcher" and '"LaunchPlanned"' in line:
                        name = "launcher-ready"
                    if name is None:
                        continue
                    seconds, record = seconds_after(line, started)
                    marks.setdefault(looked_for.get(name, "ready"), seconds)
                    if name == f"{service}.rebuilt":
                        events = int(str(record.get("events", 0)))
                if service in ("monitor", "autoscaler") and "rebuilt" in marks and await answers(soak.api, service):
                    marks.setdefault("ready", time.monotonic() - began)
                if soak.start_again_if_exited(service, jobs) is not None:
                    failed += 1
                await asyncio.sleep(POLL_SECONDS)
    except TimeoutError:
        print(f"  {service} not ready {timeout:.0f} s after its start", flush=True)
    return StartUp(service, jobs, stop_s, marks.get("active"), marks.get("rebuilt"), events, marks.get("ready"),
                   failed)


async def restarts(soak: SoakStack, flow: Flow, points: Sequence[int], in_flight: int, timeout: float,
                   done: list[StartUp]) -> None:
    """At each point (jobs submitted), every service in turn stopped and started again; the next once the jobs flow
    again (as many more submitted as are out at a time), so that one start is not timed while the flow is still held
    up by the last (the launcher is ready with its first launch, which needs a job admitted)."""
    for number, point in enumerate(points, 1):
        while flow.submitted < point:
            await asyncio.sleep(0.2)
        print(f"restart {number} of {len(points)}, at {flow.submitted:,} jobs submitted:", flush=True)
        for service in SERVICES:
            startup = await restart(soak, service, flow.submitted, timeout)
            done.append(startup)
            print(f"  {startup_row(startup)}", flush=True)
            flowing_again = min(flow.jobs, flow.submitted + in_flight)
            async with asyncio.timeout(timeout):
                while flow.submitted < flowing_again:
                    await asyncio.sleep(POLL_SECONDS)


# --- the report ----------------------------------------------------------------------------------------------


def figure(value: float | None, width: int, digits: int = 0) -> str:
    return f"{'-' if value is None or value != value else f'{value:,.{digits}f}':>{width}}"


def table_header(columns: Sequence[str]) -> list[str]:
    rss = "".join(f"{column:>11}" for column in columns)
    events = "".join(f"{service:>11}" for service in SERVICES)
    width = 11 * len(columns)
    return [f"{'':>3}{'':>10}{'':>7} {'RSS MiB':^{width}}{'submit ms':^14}{'cycle ms':^19}{'jobs':^30}"
            f"{'events in the log':^{11 * len(SERVICES)}}",
            f"{'#':>3}{'jobs':>10}{'s':>7} {rss}{'p50':>7}{'p99':>7}{'p50':>6}{'p99':>6}{'cycles':>7}{'ended':>10}"
            f"{'archived':>10}{'held':>8}{events}{'nats MiB':>10}{'JS ms':>8}"]


def table_row(label: int | str, sample: Sample, columns: Sequence[str]) -> str:
    rss = "".join(figure(sample.rss_mib[column], 10, 1) + ("*" if column in sample.restarted else " ")
                  for column in columns)
    cycle_p50, cycle_p99 = sample.cycle_ms if sample.cycle_ms else (None, None)
    submit_p50, submit_p99 = sample.submit_ms if sample.submit_ms else (None, None)
    events = "".join(figure(sample.events.get(service, 0), 11) for service in SERVICES)
    return (f"{label:>3}{sample.jobs:>10,}{sample.seconds:>7.0f} {rss}{figure(submit_p50, 7)}"
            f"{figure(submit_p99, 7)}{figure(cycle_p50, 6, 1)}{figure(cycle_p99, 6, 1)}{sample.cycles:>7,}"
            f"{sample.ended:>10,}{sample.archived:>10,}{sample.held:>8,}{events}{figure(sample.nats_mib, 10, 1)}"
            f"{figure(sample.consumer_ms, 8)}")


def startup_row(startup: StartUp) -> str:
    rebuilt = (f"{figure(startup.rebuilt_s, 6, 2)} s ({startup.rebuilt_events:,} events)"
               if startup.rebuilt_events is not None else f"{figure(startup.rebuilt_s, 6, 2)} s")
    failed = f" (after {startup.failed_starts} start(s) that failed)" if startup.failed_starts else ""
    return (f"{startup.service:<11} at {startup.jobs:>9,} jobs: stopped in {figure(startup.stop_s, 5, 2)} s; "
            f"from its start, lease {figure(startup.active_s, 5, 2)} s, rebuilt {rebuilt}, "
            f"{READY[startup.service]} {figure(startup.ready_s, 6, 2)} s{failed}")


@dataclass
class Outcome:
    """What a run saw."""

    jobs: int
    processes: dict[str, str]  # column -> the harness's name of the process
    flow: Flow
    logs: EventLogs
    samples: list[Sample] = field(default_factory=list)
    startups: list[StartUp] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    submit_seconds: float = 0.0  # from the first submission to the last answer
    ended_seconds: float | None = None  # to every job ended; None: not within the timeout
    drained: Sample | None = None  # once every job ended and was archived (None: not within the timeout)

    def started_at(self, column: str) -> list[int]:
        """The jobs submitted when `column`'s process was started again (restarted, or after it ended on its own)."""
        return sorted([s.jobs for s in self.startups if s.service == column]
                      + [e.jobs for e in self.exits if e.process == self.processes[column]])


def growth_lines(outcome: Outcome) -> list[str]:
    samples = outcome.samples
    warm = warm_up_index([(sample.jobs, sample.archived) for sample in samples],
                         round(outcome.jobs * WARM_UP_FRACTION))
    if warm is None or warm == len(samples) - 1:
        return ["too few samples after the warm-up to tell a growth"]
    first, last = samples[warm], samples[-1]
    lines = [f"RSS growth from sample {warm + 1} ({first.jobs:,} jobs, {first.archived:,} archived) to the last "
             f"({last.jobs:,} jobs; goal: within {GROWTH_GOAL_PERCENT:.0f}%):"]
    for column in outcome.processes:
        before, after = first.rss_mib[column], last.rss_mib[column]
        change = growth_percent(before, after)
        lines.append(f"  {column:<11}{figure(before, 8, 1)} -> {figure(after, 8, 1)} MiB "
                     f"{figure(change, 7, 1)}%  {_verdict(change) if column != AGENT else ''}".rstrip())
        if column == AGENT:
            lines += _agent_growth(samples, warm)
        started = [jobs for jobs in outcome.started_at(column) if first.jobs <= jobs < last.jobs]
        if not started:
            continue
        lines.append(f"  {'':<11}started again {len(started)} time(s) in between: the last figure is of the "
                     f"process started at {started[-1]:,} jobs")
        stretch = steady_stretch([column in sample.restarted for sample in samples], warm)
        if stretch is not None:
            since, until = samples[stretch[0]], samples[stretch[1]]
            steady = growth_percent(since.rss_mib[column], until.rss_mib[column])
            lines.append(f"  {'':<11}without a restart, samples {stretch[0] + 1}-{stretch[1] + 1} "
                         f"({since.jobs:,} to {until.jobs:,} jobs): {figure(since.rss_mib[column], 0, 1)} -> "
                         f"{figure(until.rss_mib[column], 0, 1)} MiB {figure(steady, 0, 1)}%")
    if first.nats_mib == first.nats_mib:  # measured: the nats-server the run started
        change = growth_percent(first.nats_mib, last.nats_mib)
        lines.append(f"  {'nats-server':<11}{figure(first.nats_mib, 8, 1)} -> {figure(last.nats_mib, 8, 1)} MiB "
                     f"{figure(change, 7, 1)}%  (JetStream making a follower's consumer: "
                     f"{figure(first.consumer_ms, 0)} -> {figure(last.consumer_ms, 0)} ms)")
    return lines


def _verdict(change: float) -> str:
    if change != change:
        return "not measured"
    return "within the goal" if abs(change) <= GROWTH_GOAL_PERCENT else "beyond the goal"


def _agent_growth(samples: Sequence[Sample], warm: int) -> list[str]:
    """The real agent's growth once it forgets ranks as fast as they end: it keeps each ended rank FORGET_SECONDS
    (a start sent again must find it known), as the services keep an ended job until its retention is over."""
    kept = kept_for_index([sample.seconds for sample in samples], warm, FORGET_SECONDS)
    if kept is None or kept == len(samples) - 1:
        return [f"  {'':<11}not measured: it keeps ended ranks {FORGET_SECONDS:.0f} s, and the run had "
                "no two samples after that"]
    since, last = samples[kept], samples[-1]
    change = growth_percent(since.rss_mib[AGENT], last.rss_mib[AGENT])
    return [f"  {'':<11}once it forgets ranks as fast as they end ({FORGET_SECONDS:.0f} s after they do), from "
            f"sample {kept + 1} ({since.jobs:,} jobs): {figure(since.rss_mib[AGENT], 0, 1)} -> "
            f"{figure(last.rss_mib[AGENT], 0, 1)} MiB {figure(change, 0, 1)}%  {_verdict(change)}"]


def report(outcome: Outcome) -> list[str]:
    columns, flow, logs = list(outcome.processes), outcome.flow, outcome.logs
    lines = ["", *table_header(columns)]
    lines += [table_row(number, sample, columns) for number, sample in enumerate(outcome.samples, 1)]
    if outcome.drained is not None:
        lines.append(table_row("end", outcome.drained, columns))
    lines.append("(*: the process was started again since the last sample; held: jobs submitted and not archived, "
                 "which the scheduler's state holds; end: once every job ended and was archived)")
    lines.append("")
    ended = ", ".join(f"{kind.removeprefix('Job').lower()} {logs.scheduler_types[kind]:,}" for kind in ENDED_EVENTS
                      if logs.scheduler_types[kind])
    seconds = outcome.submit_seconds
    lines.append(f"{flow.submitted:,} jobs submitted in {seconds:.0f} s: {flow.submitted / seconds:.1f} "
                 f"jobs/s ({flow.resent:,} submissions sent again after the client's own attempts went unanswered)")
    if outcome.ended_seconds is not None:
        lines.append(f"all ended {outcome.ended_seconds:.0f} s after the first submission: "
                     f"{flow.submitted / outcome.ended_seconds:.1f} jobs/s ({ended}); {logs.archived:,} archived by "
                     "then")
    else:
        lines.append(f"{logs.ended:,} of them ended ({ended}), {logs.archived:,} archived")
    if outcome.startups:
        lines += ["", "start-ups (from the process's start):", *(f"  {startup_row(s)}" for s in outcome.startups)]
    if outcome.exits:
        lines += ["", "processes that ended on their own (each started again):",
                  *(f"  {e.process} at {e.jobs:,} jobs, exit code {e.code}: {e.why}" for e in outcome.exits)]
    lines += ["", *growth_lines(outcome)]
    return lines


# --- the run -------------------------------------------------------------------------------------------------


async def until_submitted(flow: Flow, tasks: Sequence[asyncio.Task[None]], target: int, soak: SoakStack,
                          timeout: float) -> None:
    """Wait for `target` jobs submitted, starting again any process that ended on its own; raise if the flow or
    the restarts failed or the flow stalled `timeout` s."""
    while flow.submitted < target:
        for task in tasks:
            if task.done() and task.exception() is not None:
                task.result()  # raises what stopped it
        if time.monotonic() - flow.last_answer > timeout:
            raise TimeoutError(f"no submission answered for {timeout:.0f} s")
        soak.look_after(flow.submitted)
        await asyncio.sleep(0.1)


async def counted(soak: SoakStack, logs: EventLogs, jobs: int, count: Callable[[EventLogs], int],
                  timeout: float) -> bool:
    """Wait until `count` of the logs reaches `jobs` (looking after the processes meanwhile); whether it did
    within `timeout` s."""
    deadline = time.monotonic() + timeout
    while count(logs) < jobs:
        if time.monotonic() > deadline:
            return False
        soak.look_after(jobs)
        await asyncio.sleep(1.0)
        await logs.count()
    return True


async def soak(args: argparse.Namespace) -> Outcome:
    async with bench_servers("soak") as servers, soak_stack(servers.home / "run", servers, args.nodes,
                                                            real_agent=args.agent_every > 0,
                                                            timeout=args.timeout) as sim:
        # One user submits every job, far faster and more of them than a person's limits allow.
        settings = await sim.api.change_settings(job_retention=args.retention, max_queued_jobs_per_user=0,
                                                 submit_rate=0)
        print(f"job_retention {settings.job_retention}; {args.jobs:,} jobs, {args.in_flight} submissions out at a "
              f"time{f', every {args.agent_every}th on the real agent' if args.agent_every else ''}", flush=True)
        outcome = Outcome(args.jobs, sim.processes, Flow(sim.api, args.jobs, args.agent_every, args.rate),
                          EventLogs(servers.database_url), exits=sim.exits)
        await outcome.logs.count()
        probe = NatsProbe(servers.nats_url, servers.home / "servers" / "nats")
        sampler = Sampler(sim, outcome.logs, probe)
        flowing = asyncio.create_task(outcome.flow.run(args.in_flight))
        restarting = asyncio.create_task(restarts(sim, outcome.flow, evenly(args.jobs, args.restarts, last=False),
                                                  args.in_flight, args.timeout, outcome.startups))
        try:
            print("\n".join(table_header(list(sim.processes))), flush=True)
            for target in evenly(args.jobs, args.samples, last=True):
                await until_submitted(outcome.flow, (flowing, restarting), target, sim, args.timeout)
                outcome.samples.append(await sampler.take(outcome.flow))
                print(table_row(len(outcome.samples), outcome.samples[-1], list(sim.processes)), flush=True)
            await flowing
            outcome.submit_seconds = outcome.flow.last_answer - sampler.began
            await restarting
            if await counted(sim, outcome.logs, args.jobs, lambda logs: logs.ended, args.timeout):
                outcome.ended_seconds = time.monotonic() - sampler.began
                if await counted(sim, outcome.logs, args.jobs, lambda logs: logs.archived, args.timeout):
                    outcome.drained = await sampler.take(outcome.flow)
                    print(table_row("end", outcome.drained, list(sim.processes)), flush=True)
        finally:
            for task in (flowing, restarting):
                task.cancel()
            await asyncio.gather(flowing, restarting, return_exceptions=True)
            await probe.close()
            if args.keep_logs is not None:  # the run's folder goes with the servers, and so do their own logs
                shutil.copytree(sim.stack.home / "logs", args.keep_logs, dirs_exist_ok=True)
                for server_log in (servers.home / "servers").rglob("*.log"):
                    shutil.copy(server_log, args.keep_logs / f"server-{server_log.parent.name}-{server_log.name}")
        return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=64, help="simulated nodes")
    parser.add_argument("--retention", default="1m", help="the administrator's job_retention (at least 1m)")
    parser.add_argument("--in-flight", type=int, default=32, help="submissions out at a time")
    parser.add_argument("--rate", type=float, default=None,
                        help="jobs submitted a second at most, 1/N s apart (default: as fast as answered)")
    parser.add_argument("--samples", type=int, default=20, help="evenly spaced by jobs submitted")
    parser.add_argument("--restarts", type=int, default=4, help="times every service is stopped and started again")
    parser.add_argument("--agent-every", type=int, default=10,
                        help="every Nth job runs on the real agent (0: no real agent)")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="a folder to copy the processes' and servers' logs into at the end (the run's own "
                             "is removed)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a start-up, a stall of the submissions or the last jobs' end may take")
    args = parser.parse_args()
    if args.samples < 2 or args.jobs < args.samples:
        parser.error("--samples must be at least 2 and at most --jobs")
    print("\n".join(report(asyncio.run(soak(args)))))


if __name__ == "__main__":
    main()
