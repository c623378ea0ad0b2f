"""How fast a checkpoint-resume job gets away from a fault (J12, M2–M4), on the real stack.

    python -m bench.fault_drill [--drills 5] [--kind mark|kill]

Starts NATS, PostgreSQL, the four services and three node agents (tests/e2e/cluster-resilient.yaml,
heartbeats every 0.5 s, a node lost after 3 s of silence), runs a 1-node PyTorch job that saves on
the checkpoint signal (examples/algorithms/pytorch-resumable), and drills repeatedly: wait until the
job trains, then fault its node — an administrator's mark of its board (`mark`), or kill -9 of its
node agent (`kill`) — and measure from that moment:

- to the checkpoint signal: when the node's agent sent it (its log), for `mark`;
- to the saved checkpoint: the job's "saved a checkpoint" line reached the log stream;
- to running again: every rank of the next attempt started on another node.

Between drills the fault is cleared (the mark removed, the agent restarted). Medians over the drills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from datetime import datetime
from pathlib import Path

from bench.servers import bench_servers
from client.api import TrainyardClient
from devstack.harness import Stack
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef

CLUSTER = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "cluster-resilient.yaml"
DrillStack = Stack[TrainyardClient]


def job(drills: int) -> JobSpec:
    return JobSpec(name="drill", mode="pytorch", nodes=1, flavors=["cpu-1"], pool="resilient",
                   algorithm=AlgorithmRef(name="pytorch-resumable"), output=OutputRef(name="drill"),
                   command="python3 train.py --steps 100000 --step-seconds 0.1",
                   checkpoint_resume=CheckpointResume(max_resumes=drills + 1, graceful_shutdown_seconds=20))


def signal_sent_after(stack: DrillStack, node: str, since: float) -> float | None:
    """Seconds from `since` (epoch) to the agent's first checkpoint signal after it, from its JSON log."""
    path = stack.home / "logs" / f"agent-{node}.log"
    for line in path.read_text(errors="replace").splitlines():
        if '"agent.checkpoint_signal"' not in line:
            continue
        at = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
        if at >= since:
            return at - since
    return None


async def wait_running(stack: DrillStack, job_id: str, after_attempt: int, timeout: float = 180) -> tuple[int, str]:
    api = await stack.api()
    async with asyncio.timeout(timeout):
        while True:
            view = (await api.get_job(job_id)).job
            if view.status not in ("running", "queued"):
                raise RuntimeError(f"the job {view.status}: {view.reason}")
            if view.attempt > after_attempt and view.instances and all(i.state == "running" for i in view.instances):
                return view.attempt, view.placement[0].node
            await asyncio.sleep(0.05)


async def count_lines(stack: DrillStack, job_id: str, pattern: str) -> int:
    return sum(bool(re.search(pattern, line)) for line in await stack.logs(job_id))


async def wait_for_line(stack: DrillStack, job_id: str, pattern: str, count: int, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while await count_lines(stack, job_id, pattern) < count:
            await asyncio.sleep(0.05)


async def drill(stack: DrillStack, kind: str, drills: int) -> list[dict[str, float | None]]:
    api = await stack.up()
    accepted = await api.submit(job(drills))
    attempt, node = await wait_running(stack, accepted.job_id, 0)
    results: list[dict[str, float | None]] = []
    for number in range(1, drills + 1):
        trained = await count_lines(stack, accepted.job_id, r"step \d+ loss")
        await wait_for_line(stack, accepted.job_id, r"step \d+ loss", trained + 5)  # it trains
        started, wall = time.monotonic(), time.time()
        if kind == "mark":
            await api.mark_component(node, "board:0", reason=f"drill {number}")
        else:
            stack.crash(f"agent-{node}")
        if kind == "mark":
            await wait_for_line(stack, accepted.job_id, r"saved a checkpoint", number)
        saved = time.monotonic() - started
        attempt, moved_to = await wait_running(stack, accepted.job_id, attempt)
        running = time.monotonic() - started
        signal = signal_sent_after(stack, node, wall) if kind == "mark" else None
        results.append({"signal": signal, "saved": saved if kind == "mark" else None, "running": running})
        print(f"drill {number}: {node} -> {moved_to}: signal {signal if signal is None else round(signal, 2)} s, "
              f"running again after {running:.2f} s", flush=True)
        if kind == "mark":
            await api.mark_component(node, "board:0", faulty=False)
        else:
            stack.start(f"agent-{node}")
        node = moved_to
    return results


def median(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f} s" if known else "n/a"


async def main_async(args: argparse.Namespace) -> None:
    async with bench_servers("drill") as servers:
        stack = DrillStack(servers.home / "stack", servers.nats_url, servers.database_url,
                           connect=TrainyardClient.open, cluster=CLUSTER)
        try:
            results = await drill(stack, args.kind, args.drills)
        finally:
            await stack.close()
    print(f"\n{args.kind}: {args.drills} drills")
    print(f"fault -> checkpoint signal sent   {median([r['signal'] for r in results])}")
    print(f"fault -> checkpoint saved         {median([r['saved'] for r in results])}")
    print(f"fault -> running on another node  {median([r['running'] for r in results])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drills", type=int, default=5)
    parser.add_argument("--kind", choices=("mark", "kill"), default="mark")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
