"""The operator's view of a busy stack, from real Prometheus data: the charts of docs/operations.md.

    python -m bench.dashboard [--agents 4] [--waves 6] [--jobs 150] [--png docs/images/operations.png]

A stack of `--agents` agents of 16 CPUs runs with every process serving its metrics and a Prometheus scraping them
every 5 s (as `make up OPS=1` runs it). Every 20 s a wave of `--jobs` one-CPU jobs of 4 s and two 2-node jobs of
10 s is submitted, more than the nodes run at once, so that a queue forms and drains; during the fourth wave one
agent is killed (its node is counted lost, then comes back when the agent starts again). Then Prometheus is asked
for the run, as the dashboard (deploy/grafana/trainyard.json) asks it, and six panels are drawn with matplotlib:
the queue, admissions and job ends, request latency, nodes, lags and the scheduler's cycle. The figures printed
are read off the same queries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from bench.servers import bench_servers
from bench.throughput import cluster_config, trivial_spec
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.ops import metrics_env, start_prometheus
from devstack.servers import free_port
from devstack.stack import REPO_ROOT
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef

STEP_SECONDS = 5
SUBMIT_BUCKETS = ('sum by (le) (rate(messaging_process_duration_seconds_bucket'
                  '{messaging_destination_name="trainyard.cmd.jobs.submit"}[30s]))')
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("queued jobs", (("by priority", 'sum by (trainyard_priority) (trainyard_jobs_queued)'),)),
    ("jobs per second", (("admitted", "sum(rate(trainyard_scheduler_admissions_total[30s]))"),
                         ("succeeded", "sum(rate(trainyard_events_recorded_total"
                                       '{trainyard_event_type="JobSucceeded"}[30s]))'))),
    ("submit latency (s)", (("p50", f"histogram_quantile(0.5, {SUBMIT_BUCKETS})"),
                            ("p99", f"histogram_quantile(0.99, {SUBMIT_BUCKETS})"))),
    ("nodes", (("up", 'sum(trainyard_nodes{trainyard_node_state="up"})'),
               ("lost", 'sum(trainyard_nodes{trainyard_node_state="lost"})'))),
    ("lag (events, messages)", (("outbox, all services", "sum(trainyard_outbox_lag)"),
                                ("followers, all", "sum(trainyard_follower_lag)"))),
    ("scheduling cycle (s)", (("p99", "histogram_quantile(0.99, sum by (le) "
                                      "(rate(trainyard_scheduler_cycle_duration_seconds_bucket[30s])))"),)),
)


def gang_spec(index: int) -> JobSpec:
    return JobSpec(name=f"pair-{index}", mode="pytorch", nodes=2, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="pytorch-ddp"), command="sleep 10", output=OutputRef(name="pairs"))


def query_range(prometheus: str, expression: str, start: float, end: float) -> list[dict[str, Any]]:
    arguments = {"query": expression, "start": f"{start:.0f}", "end": f"{end:.0f}", "step": str(STEP_SECONDS)}
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{urllib.parse.urlencode(arguments)}",
                                timeout=30) as answer:
        body = json.load(answer)
    return list(body["data"]["result"])


async def run(args: argparse.Namespace) -> dict[str, list[tuple[str, list[dict[str, Any]]]]]:
    async with bench_servers("dashboard") as servers:
        home = servers.home / "stack"
        home.mkdir()
        stack = Stack(home, None, servers.database_url, connect=TrainyardClient.open,
                      cluster=cluster_config(servers.home / "cluster.yaml", args.agents), env=metrics_env(home))
        prometheus = start_prometheus(stack.processes, free_port())
        try:
            print(f"starting the stack with {args.agents} agents; Prometheus at {prometheus}", flush=True)
            api = await stack.up()
            began = time.time()
            await asyncio.sleep(15)  # a quiet start on the charts
            submitted = 0
            for wave in range(args.waves):
                print(f"wave {wave + 1} of {args.waves}: {args.jobs} jobs of 4 s and 2 pairs", flush=True)
                for _ in range(args.jobs):
                    await api.submit(msgspec.structs.replace(trivial_spec(submitted, output="waves"),
                                                             command="sleep 4"))
                    submitted += 1
                for pair in range(2):
                    await api.submit(gang_spec(wave * 2 + pair))
                if wave == 3:
                    print("  node-1's agent killed; started again 25 s later", flush=True)
                    stack.crash("agent-node-1")
                    await asyncio.sleep(25)
                    stack.start("agent-node-1")
                await asyncio.sleep(20)
            print("waiting for the queue to drain", flush=True)
            while (await api.queue_status()).queued_jobs or (await api.queue_status()).running_jobs:
                await asyncio.sleep(2)
            await asyncio.sleep(15)
            end = time.time()
            return {title: [(label, query_range(prometheus, expression, began, end)) for label, expression in lines]
                    for title, lines in PANELS}
        finally:
            await stack.close()


def draw(panels: dict[str, list[tuple[str, list[dict[str, Any]]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 2, figsize=(12, 9), sharex=True)
    start = min((float(series["values"][0][0]) for lines in panels.values() for _, found in lines
                 for series in found if series["values"]), default=0.0)
    for axis, (title, lines) in zip(axes.flat, panels.items(), strict=True):
        for label, found in lines:
            for series in found:
                suffix = ", ".join(f"{v}" for k, v in series["metric"].items() if k != "__name__")
                xs = [(float(t) - start) / 60 for t, _ in series["values"]]
                ys = [float(v) if v not in ("NaN", "+Inf") else float("nan") for _, v in series["values"]]
                axis.plot(xs, ys, label=f"{label} {suffix}".strip())
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="upper right")
    for axis in axes[-1]:
        axis.set_xlabel("minutes")
    figure.suptitle("Trainyard from Prometheus: waves of jobs, one agent killed in the fourth")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    print(f"chart: {path}")


def summary(panels: dict[str, list[tuple[str, list[dict[str, Any]]]]]) -> None:
    for title, lines in panels.items():
        for label, found in lines:
            values = [float(v) for series in found for _, v in series["values"] if v not in ("NaN", "+Inf")]
            if values:
                print(f"  {title:<24} {label:<22} max {max(values):10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=150)
    parser.add_argument("--png", type=Path, default=REPO_ROOT / "docs" / "images" / "operations.png")
    args = parser.parse_args()
    panels = asyncio.run(run(args))
    summary(panels)
    draw(panels, args.png)


if __name__ == "__main__":
    main()
