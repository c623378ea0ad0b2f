"""NATS servers killed while jobs run: the stack on a cluster of three, every stream kept on all three.

    python -m bench.nats_failover [--jobs 200] [--rate 10]

`--jobs` one-CPU jobs of half a second are submitted at `--rate` a second to a stack of two agents on a cluster of
three NATS servers (`make up NATS=3`). A quarter of the way in, a server that does not lead the event history's
stream is killed (-9) and started again 10 s later; at three quarters, the stream's leader itself. For each kill:
how long until the stream had a leader again (asked every 0.1 s), the slowest submission answered meanwhile, and how
long until the first job submitted after the kill had succeeded. At the end: every job's outcome, and whether every
event each service stored is in the stream (published exactly once).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import asyncpg

from bench.servers import bench_servers
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.natscluster import NatsCluster, published_events, stream_leader
from devstack.natslogins import service_login
from libs.contracts import subjects
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef

SERVICES = ["scheduler", "launcher", "monitor", "autoscaler"]
DOWN_SECONDS = 10.0


def job_spec(index: int) -> JobSpec:
    return JobSpec(name=f"through-{index}", flavors=["cpu-1"], algorithm=AlgorithmRef(name="pytorch-ddp"),
                   command="sleep 0.5", output=OutputRef(name="failover"))


@dataclass
class Kill:
    what: str
    at: float = 0.0  # monotonic
    wall: float = 0.0  # time.time(), to compare with a job's end
    leader_again: float | None = None  # seconds after the kill
    first_after: str | None = None  # the first job submitted after the kill
    first_after_succeeded: float | None = None
    slowest_submit: float = 0.0


@dataclass
class Run:
    submitted: list[tuple[str, float, float]] = field(default_factory=list)  # job, sent at, answered after
    kills: list[Kill] = field(default_factory=list)


async def leader_again(stack: Stack[TrainyardClient], gone: str, kill: Kill) -> None:
    login = service_login(stack.home, "scheduler")
    while (await stream_leader(stack.nats_url, login, subjects.EVENTS_STREAM))[0] == gone:
        await asyncio.sleep(0.1)
    kill.leader_again = time.monotonic() - kill.at


async def drill(args: argparse.Namespace) -> Run:
    run = Run()
    async with bench_servers("natsfailover") as servers:
        home = servers.home / "stack"
        home.mkdir()
        stack = Stack(home, None, servers.database_url, connect=TrainyardClient.open, nats_servers=3)
        cluster: NatsCluster | None = stack.nats_cluster
        assert cluster is not None
        try:
            api = await stack.up()
            login = service_login(home, "scheduler")
            pending: set[asyncio.Task[None]] = set()
            for index in range(args.jobs):
                if index in (args.jobs // 4, 3 * args.jobs // 4):
                    leader, replicas = await stream_leader(stack.nats_url, login, subjects.EVENTS_STREAM)
                    assert replicas == 3, f"the event history is kept on {replicas} servers, not 3"
                    others = [i for i in range(cluster.size) if cluster.name(i) != leader]
                    victim = others[0] if index < args.jobs // 2 else cluster.index_of(leader)
                    kill = Kill(what="the stream's leader" if cluster.name(victim) == leader else "a follower",
                                at=time.monotonic(), wall=time.time())
                    print(f"job {index}: killing {cluster.name(victim)} ({kill.what})", flush=True)
                    cluster.kill(victim)
                    run.kills.append(kill)
                    if cluster.name(victim) == leader:
                        task = asyncio.create_task(leader_again(stack, leader, kill))
                        pending.add(task)
                    asyncio.get_running_loop().call_later(DOWN_SECONDS, cluster.start, victim)
                sent = time.monotonic()
                accepted = await api.submit(job_spec(index))
                answered = time.monotonic() - sent
                run.submitted.append((accepted.job_id, sent, answered))
                for kill in run.kills:
                    if kill.first_after is None:
                        kill.first_after = accepted.job_id
                    if sent - kill.at < DOWN_SECONDS + 5:
                        kill.slowest_submit = max(kill.slowest_submit, answered)
                await asyncio.sleep(max(0.0, 1 / args.rate - answered))
            await asyncio.gather(*pending)
            print("waiting for every job to end", flush=True)
            outcomes: dict[str, str] = {}
            for job_id, _, _ in run.submitted:
                job = await stack.wait_until(job_id, "ended", timeout=300)
                outcomes[job_id] = job.status
                for kill in run.kills:
                    if kill.first_after == job_id and job.ended_at is not None:
                        kill.first_after_succeeded = job.ended_at.timestamp() - kill.wall
            failed = {job_id: status for job_id, status in outcomes.items() if status != "succeeded"}
            published = await published_events(stack.nats_url, login, SERVICES)
            db = await asyncpg.connect(servers.database_url)
            try:
                stored = {s: int(await db.fetchval(f"SELECT count(*) FROM {s}.events")) for s in SERVICES}
            finally:
                await db.close()
            report(run, failed, published, stored)
            return run
        finally:
            await stack.close()


def report(run: Run, failed: dict[str, str], published: dict[str, int], stored: dict[str, int]) -> None:
    latencies = sorted(answered for _, _, answered in run.submitted)
    print(f"\n{len(run.submitted)} jobs, {len(failed)} not succeeded {failed or ''}; submit p50 "
          f"{latencies[len(latencies) // 2] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    print(f"{'killed':<20} {'leader again':>13} {'slowest submit':>15} {'next job succeeded':>19}")
    for kill in run.kills:
        leader = f"{kill.leader_again:.1f} s" if kill.leader_again is not None else "(kept)"
        after = f"{kill.first_after_succeeded:.1f} s" if kill.first_after_succeeded is not None else "-"
        print(f"{kill.what:<20} {leader:>13} {kill.slowest_submit * 1000:>12.0f} ms {after:>19}")
    for service in SERVICES:
        mark = "ok" if published[service] == stored[service] else "MISSING"
        print(f"  {service:<11} stored {stored[service]:>6}  in the stream {published[service]:>6}  {mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(drill(args))


if __name__ == "__main__":
    main()

