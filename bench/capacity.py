"""Capacity: the real services driven by simulated node agents, by the thousand.

    python -m bench.capacity [--nodes 1000,10000] [--per-connection 500] [--seconds 30] [--queued 200]
                             [--jobs 10000] [--job-seconds 5]

For each node count, a fresh stack of the four real services (no real agent) on the tests' NATS and PostgreSQL, and
simulated agents in this process: each registers with its own node credential (which the monitor checks, as for a
real agent) and from then on heartbeats every 2 s (the platform's default), with an empty probe. One NATS connection
carries `--per-connection` simulated agents, so the NATS server is one without role enforcement: what is measured
is the services, not the auth callout of 10,000 logins. `--queued` jobs wait for a board no node has (flavor
`no-board-1`), so every scheduling cycle looks at them and at every node (a job of a pool no node serves would be
passed over by the cycle without a look).

Measured: how long all nodes took to register; then over `--seconds` of heartbeats alone: each service's CPU (from
/proc), NATS's and PostgreSQL's, the monitor's CPU per heartbeat, the events recorded (none should be), whether any
node was counted lost (the monitor falling behind its heartbeats), and the scheduler's cycles (from its own metrics
endpoint). Then one array of `--jobs` single-node jobs, each a simulated process that exits after `--job-seconds`
(bench/simagents.py: the launcher's ports, start and stop requests answered, start and exit reported as an agent
reports them): how fast the jobs are admitted and ended, what each component spends meanwhile, the database's
commits, rows and write-ahead log, and each service's memory at the end. The first component to saturate is the
one whose CPU share nears a core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import nats
from nats.aio.client import Client

from bench.cpu import Spent, look, spent
from bench.servers import bench_servers
from bench.simagents import SimulatedAgents
from bench.simnodes import HEARTBEAT_SECONDS, Heartbeats, node_name, register_all
from bench.throughput import trivial_spec
from client.api import NoAnswer, TrainyardClient
from devstack.harness import Stack
from devstack.ops import metrics_env
from devstack.stack import SERVICES
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef


@dataclass(frozen=True)
class Load:
    """What the database had done by one moment: its commits, rows written and write-ahead log, and the events the
    services recorded."""

    commits: int
    rows: int
    wal_bytes: int
    events: int  # recorded by the services, all together


def shares(used: Spent, seconds: float, prefix: str = "") -> dict[str, float]:
    """Where the CPU of `seconds` went, as shares of one core: the machine (both cores), the simulated agents (this
    process), the run's NATS server, its PostgreSQL (its backends included: those that ended meanwhile in what the
    server reaped) and each service."""
    by_role = used.by_role
    figures = {"machine_busy_share": used.busy / used.total if used.total else 0.0,
               "simulated_agents_cpu_share": by_role.get("benchmark client", 0.0) / seconds,
               "nats_cpu_share": by_role.get("nats-server", 0.0) / seconds,
               "postgres_cpu_share": sum(cpu for role, cpu in by_role.items() if role.startswith("postgres")) / seconds,
               **{f"{role}_cpu_share": by_role.get(role, 0.0) / seconds for role in SERVICES}}
    return {prefix + key: value for key, value in figures.items()}


async def load(database_url: str) -> Load:
    connection = await asyncpg.connect(database_url)
    try:
        row = await connection.fetchrow(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS rows,"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal"
            " FROM pg_stat_database WHERE datname = current_database()")
        events = sum([int(await connection.fetchval(f"SELECT coalesce(max(position), 0) FROM {role}.events"))
                      for role in SERVICES])
    finally:
        await connection.close()
    assert row is not None
    return Load(int(row["xact_commit"]), int(row["rows"]), int(row["wal"]), events)


ENDED = ("succeeded", "failed", "stopped", "expired")


async def run_jobs(api: TrainyardClient, connections: list[Client], args: argparse.Namespace, database_url: str,
                   *folders: Path) -> dict[str, float]:
    """One array of `--jobs` single-node jobs on the simulated nodes (each a simulated process of `--job-seconds`),
    heartbeats going on: from the submit to every job admitted and to every job ended, and what it cost."""
    agents = SimulatedAgents(connections[0].jetstream(), seconds=args.job_seconds)
    for nc in connections:
        await agents.serve(nc)
    try:
        cpu_before, load_before = look(*folders), await load(database_url)
        began = time.monotonic()
        accepted = await api.submit_array(trivial_spec("{index}", output="capacity"), indices=f"0-{args.jobs - 1}")
        answered = time.monotonic()
        admitted_at, shown = 0.0, began
        while True:
            statuses = (await api.get_array(accepted.array_id, limit=1)).array.statuses
            now = time.monotonic()
            if not admitted_at and not statuses.get("queued"):
                admitted_at = now
            if sum(statuses.get(status, 0) for status in ENDED) >= args.jobs:
                break
            if now - shown >= 5:
                shown = now
                print(f"  {now - began:5.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())),
                      flush=True)
            await asyncio.sleep(0.25)
        ended = time.monotonic()
        cpu_after, load_after = look(*folders), await load(database_url)
    finally:
        await agents.close()
    print(f"  {args.jobs} jobs: submitted in {answered - began:.1f} s, admitted by {admitted_at - began:.1f} s, "
          f"ended by {ended - began:.1f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())), flush=True)
    seconds = ended - began
    used = spent(cpu_before, cpu_after)
    figures = {"jobs_submit_seconds": answered - began,
               "jobs_admitted_per_second": args.jobs / (admitted_at - answered) if admitted_at > answered else 0.0,
               "jobs_ended_per_second": args.jobs / seconds,
               "jobs_failed": float(args.jobs - statuses.get("succeeded", 0)),
               **shares(used, seconds, "jobs_"),
               "jobs_commits_per_second": (load_after.commits - load_before.commits) / seconds,
               "jobs_rows_per_second": (load_after.rows - load_before.rows) / seconds,
               "jobs_wal_mib_per_second": (load_after.wal_bytes - load_before.wal_bytes) / seconds / 2**20,
               "jobs_events_per_job": (load_after.events - load_before.events) / args.jobs,
               "jobs_simulated_exits": float(agents.exited)}
    return figures


def scrape(home: Path, service: str) -> str:
    """The text of `service`'s metrics endpoint (its target file under `home/metrics`)."""
    [target] = [json.loads(path.read_text())[0] for path in (home / "metrics").glob(f"{service}-*.json")]
    with urllib.request.urlopen(f"http://{target['targets'][0]}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of the series of `name` whose labels contain `labels`."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", re.M)
    return sum(float(value) for found, value in pattern.findall(text) if labels in (found or ""))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_size(count: int, args: argparse.Namespace) -> dict[str, float | str]:
    async with bench_servers(f"capacity{count}") as servers:
        home = servers.home / "stack"
        home.mkdir()
        cluster = servers.home / "cluster.yaml"
        cluster.write_text("flavors:\n  - {name: cpu-1, cpus: 1, memory_mib: 1024}\n"
                           "  - {name: no-board-1, cpus: 1, memory_mib: 1024, accelerators: 1, board: none-here}\n"
                           "nodes: []\n")
        stack = Stack(home, servers.nats_url, servers.database_url, connect=TrainyardClient.open, cluster=cluster,
                      timings={"TRAINYARD_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS)}, env=metrics_env(home))
        try:
            stack.start_all(agents=False)
            api = await stack.api(timeout=60)
            async with asyncio.timeout(120):
                while True:  # every service answers (the autoscaler is the one the others do not wait for)
                    with contextlib.suppress(NoAnswer):
                        await api.queue_status()
                        await api.list_jobs()
                        break
                    await asyncio.sleep(0.5)
            # One user submits every job, more of them than a person's limits allow.
            await api.change_settings(max_queued_jobs_per_user=0, submit_rate=0)
            secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"]).read_text().strip()
            names = [node_name(i) for i in range(count)]
            groups = [names[i:i + args.per_connection] for i in range(0, count, args.per_connection)]
            connections = [await nats.connect(servers.nats_url) for _ in groups]
            beats = Heartbeats()
            began = time.monotonic()
            await asyncio.gather(*(register_all(nc, group, secret, beats)
                                   for nc, group in zip(connections, groups, strict=True)))
            registered = time.monotonic() - began
            print(f"  {count} nodes registered in {registered:.1f} s", flush=True)
            for index in range(args.queued):
                await api.submit(JobSpec(name=f"held-{index}", flavors=["no-board-1"], command="true",
                                         algorithm=AlgorithmRef(name="pytorch-ddp"), output=OutputRef(name="held")))
            await asyncio.sleep(6)  # every node heartbeating a while before measuring: the monitor's steady state
            scheduler_before = scrape(home, "scheduler")
            before, load_before = look(home, servers.home), await load(servers.database_url)
            sent_before = beats.sent
            await asyncio.sleep(args.seconds)
            sent = beats.sent - sent_before
            after, load_after = look(home, servers.home), await load(servers.database_url)
            await asyncio.sleep(HEARTBEAT_SECONDS)
            scheduler_after, monitor = scrape(home, "scheduler"), scrape(home, "monitor")
            used = spent(before, after)
            cycle = "trainyard_scheduler_cycle_duration_seconds"
            cycles = metric(scheduler_after, f"{cycle}_count") - metric(scheduler_before, f"{cycle}_count")
            cycle_seconds = metric(scheduler_after, f"{cycle}_sum") - metric(scheduler_before, f"{cycle}_sum")
            figures: dict[str, float | str] = {
                "nodes": count, "registered_seconds": registered, "heartbeats_per_second": sent / args.seconds,
                "lost": metric(monitor, "trainyard_nodes", 'trainyard_node_state="lost"'),
                "up": metric(monitor, "trainyard_nodes", 'trainyard_node_state="up"'),
                "cycles_per_second": cycles / args.seconds,
                "cycle_ms": cycle_seconds / cycles * 1000 if cycles else 0.0,
                **shares(used, args.seconds),
                "events_recorded": float(load_after.events - load_before.events)}
            figures["monitor_us_per_heartbeat"] = used.by_role.get("monitor", 0.0) / max(1, sent) * 1e6
            if args.jobs:
                figures |= await run_jobs(api, connections, args, servers.database_url, home, servers.home)
            for role in SERVICES:  # with the jobs' state, when they ran
                figures[f"{role}_rss_mib"] = rss_mib(stack.processes.processes[role].pid)
            await beats.stop()
            for nc in connections:
                await nc.close()
            return figures
        finally:
            await stack.close()


def report(rows: list[dict[str, float | str]]) -> None:
    keys = [key for key in rows[0] if key != "nodes"]
    print(f"\n{'':<34}" + "".join(f"{int(row['nodes']):>12,}" for row in rows))
    for key in keys:
        print(f"{key:<34}" + "".join(f"{float(row[key]):>12.2f}" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000,10000")
    parser.add_argument("--per-connection", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--queued", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=10000, help="jobs of one array run on the simulated nodes")
    parser.add_argument("--job-seconds", type=float, default=5.0, help="how long each simulated process runs")
    args = parser.parse_args()
    rows = []
    for count in (int(n) for n in args.nodes.split(",")):
        print(f"{count} simulated nodes", flush=True)
        rows.append(asyncio.run(one_size(count, args)))
    report(rows)


if __name__ == "__main__":
    main()
