"""Capacity: the real services driven by simulated node agents, by the thousand.

    python -m bench.capacity [--nodes 1000,10000] [--per-connection 500] [--seconds 30] [--queued 200]

For each node count, a fresh stack of the four real services (no real agent) on the tests' NATS and PostgreSQL, and
simulated agents in this process: each registers with its own node credential (which the monitor checks, as for a
real agent) and then heartbeats every 2 s (the platform's default), with an empty probe; nothing is started on
them. One NATS connection carries `--per-connection` simulated agents, so the NATS server is one without role
enforcement: what is measured is the services, not the auth callout of 10,000 logins. `--queued` jobs wait in a
pool no node serves, so every scheduling cycle looks at them and at every node.

Measured: how long all nodes took to register, then over `--seconds` of heartbeats: each service's CPU (from
/proc) and memory, the monitor's CPU per heartbeat, whether any node was counted lost (the monitor falling behind
its heartbeats), and the scheduler's cycles (from its own metrics endpoint). The first component to saturate is
the one whose CPU share nears a core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import nats
from nats.aio.client import Client

from bench.cpu import look, spent
from bench.servers import bench_servers
from client.api import NoAnswer, TrainyardClient
from libs.auth import bearer_headers, issue_node_token
from libs.contracts import subjects
from libs.contracts.agent import Heartbeat, NodeAccepted, RegisterNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.messages import CommandError
from libs.devstack.harness import Stack
from libs.devstack.ops import metrics_env
from libs.devstack.stack import SERVICES
from libs.messaging.rpc import call

HEARTBEAT_SECONDS = 2.0
REGISTERING_AT_ONCE = 64


def node_name(index: int) -> str:
    return f"sim-{index:05d}"


async def register_all(nc: Client, names: list[str], secret: str) -> list[str]:
    """Register `names` (at most REGISTERING_AT_ONCE at once); their tokens."""
    gate = asyncio.Semaphore(REGISTERING_AT_ONCE)

    async def one(name: str) -> str:
        token = issue_node_token(secret, name)
        info = NodeInfo(name=name, address="10.0.0.1", cpus=16, memory_mib=65536)
        async with gate:
            reply = await call(nc, subjects.REGISTER_NODE, RegisterNode(node=info), timeout=60,
                               reply_type=NodeAccepted | CommandError, token=token)
        if isinstance(reply, CommandError):
            raise RuntimeError(f"{name} was refused: {reply.message}")
        return token

    return list(await asyncio.gather(*(one(name) for name in names)))


async def heartbeats(nc: Client, nodes: list[tuple[str, str]], until: float) -> int:
    """Every node's heartbeat every HEARTBEAT_SECONDS, spread evenly over the period, until `until`; how many."""
    sent = 0
    gap = HEARTBEAT_SECONDS / max(1, len(nodes))
    while time.monotonic() < until:
        began = time.monotonic()
        for index, (name, token) in enumerate(nodes):
            beat = Heartbeat(node=name, sent_at=datetime.now(UTC))
            await nc.publish(subjects.heartbeat(name), encode(beat), headers=bearer_headers(token))
            sent += 1
            if index % 50 == 49 and (ahead := began + gap * (index + 1) - time.monotonic()) > 0:
                await asyncio.sleep(ahead)
        await asyncio.sleep(max(0.0, began + HEARTBEAT_SECONDS - time.monotonic()))
    return sent


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
        cluster.write_text("flavors:\n  - {name: cpu-1, cpus: 1, memory_mib: 1024}\nnodes: []\n")
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
            secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"]).read_text().strip()
            names = [node_name(i) for i in range(count)]
            groups = [names[i:i + args.per_connection] for i in range(0, count, args.per_connection)]
            connections = [await nats.connect(servers.nats_url) for _ in groups]
            began = time.monotonic()
            tokens = await asyncio.gather(*(register_all(nc, group, secret) for nc, group in zip(connections, groups,
                                                                                                  strict=True)))
            registered = time.monotonic() - began
            print(f"  {count} nodes registered in {registered:.1f} s", flush=True)
            for index in range(args.queued):
                await api.submit(JobSpec(name=f"held-{index}", flavors=["cpu-1"], pool="held", command="true",
                                         algorithm=AlgorithmRef(name="pytorch-ddp"), output=OutputRef(name="held")))
            # Heartbeats for a while before measuring, so that the monitor is in its steady state.
            settle = time.monotonic() + 6
            await asyncio.gather(*(heartbeats(nc, list(zip(group, group_tokens, strict=True)), settle)
                                   for nc, group, group_tokens in zip(connections, groups, tokens, strict=True)))
            scheduler_before = scrape(home, "scheduler")
            before = look(home, servers.home)
            until = time.monotonic() + args.seconds
            sent = sum(await asyncio.gather(*(heartbeats(nc, list(zip(group, group_tokens, strict=True)), until)
                                              for nc, group, group_tokens in zip(connections, groups, tokens,
                                                                                 strict=True))))
            after = look(home, servers.home)
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
                "machine_busy_share": used.busy / used.total if used.total else 0.0}
            for role in SERVICES:
                figures[f"{role}_cpu_share"] = used.by_role.get(role, 0.0) / args.seconds
                figures[f"{role}_rss_mib"] = rss_mib(stack.processes.processes[role].pid)
            figures["monitor_us_per_heartbeat"] = used.by_role.get("monitor", 0.0) / max(1, sent) * 1e6
            for nc in connections:
                await nc.close()
            return figures
        finally:
            await stack.close()


def report(rows: list[dict[str, float | str]]) -> None:
    keys = [key for key in rows[0] if key != "nodes"]
    print(f"\n{'':<28}" + "".join(f"{int(row['nodes']):>12,}" for row in rows))
    for key in keys:
        print(f"{key:<28}" + "".join(f"{float(row[key]):>12.2f}" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000,10000")
    parser.add_argument("--per-connection", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--queued", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for count in (int(n) for n in args.nodes.split(",")):
        print(f"{count} simulated nodes", flush=True)
        rows.append(asyncio.run(one_size(count, args)))
    report(rows)


if __name__ == "__main__":
    main()
