"""A chaos drill on the whole stack (devstack/chaos.py): jobs run while faults come in turn.

    python -m bench.chaos [--jobs 1000] [--agents 8] [--fault-every 20]

Starts a NATS server and a PostgreSQL server of its own (so both can be crashed), the four services
with a standby each, and `--agents` node agents on this machine; submits `--jobs` short jobs of mixed
shapes (one and two nodes, a tenth meant to fail) spread over the drill while, every `--fault-every`
seconds: each service's active process is killed -9 (twice over, so the standby that took over is
killed in its turn), NATS is killed -9 and started again, PostgreSQL is stopped `-m immediate` and
started again, and an agent is killed -9 and started again. Then it checks that every acknowledged
job exists once, that no rank was started twice, that each job ended as its processes did, and that
the services rebuild the same state; and prints how long each fault took to recover from.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from client.api import TrainyardClient
from devstack.chaos import Drill, Postgres, job_mix, recovery_table
from devstack.harness import Stack
from devstack.servers import admin_url, create_database, free_port, start_postgres, stop_postgres
from devstack.stack import REPO_ROOT, SERVICES

ALGORITHMS = REPO_ROOT / "tests" / "e2e" / "algorithms"  # the sleeper the jobs run


def cluster_config(path: Path, agents: int) -> Path:
    nodes = "\n".join(f"  - {{name: node-{i}, address: 127.0.0.1, cpus: 2, memory_mib: 4096}}"
                      for i in range(1, agents + 1))
    path.write_text(f"flavors:\n  - {{name: cpu-1, cpus: 1, memory_mib: 512}}\nnodes:\n{nodes}\n")
    return path


async def drill(args: argparse.Namespace, home: Path) -> None:
    home.chmod(0o755)  # PostgreSQL runs as another user when started as root
    folder, port = home / "postgres", free_port()
    start_postgres(folder, port)
    try:
        await create_database(admin_url(folder, port, "postgres", socket=False), "trainyard")
        database_url = admin_url(folder, port, "trainyard", socket=False)
        stack = Stack(home / "stack", None, database_url, connect=TrainyardClient.open,
                      cluster=cluster_config(home / "cluster.yaml", args.agents), algorithms=ALGORITHMS)
        try:
            chaos = Drill(stack, database_url, Postgres(folder, port), progress=lambda line: print(line, flush=True))
            faults = chaos.faults(services=[*SERVICES, *SERVICES], nats=True, agents=1, postgres=True)
            report = await chaos.run(job_mix(args.jobs), faults, fault_every=args.fault_every,
                                     end_timeout=args.end_timeout)
        finally:
            await stack.close()
    finally:
        stop_postgres(folder)
    print()
    print(f"jobs submitted {args.jobs}, acknowledged {len(report.acknowledged)}, "
          f"unacknowledged {len(report.unacknowledged)}; {args.agents} agents; {report.seconds:.0f} s in all")
    print("ended: " + ", ".join(f"{status} {count}" for status, count in sorted(report.statuses.items())))
    print(f"rank starts recorded by the agents: {report.starts}")
    print()
    print("\n".join(recovery_table(report)))
    print()
    print(f"broken promises: {len(report.problems)}")
    for problem in report.problems:
        print(f"  {problem}")
    print(f"jobs a fault ended otherwise than their processes would have: {len(report.fault_ended)}")
    for line in report.fault_ended:
        print(f"  {line}")
    for line in report.unacknowledged:
        print(f"  unacknowledged: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    parser.add_argument("--end-timeout", type=float, default=900.0, help="how long to wait for the jobs to end")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainyard-chaos-") as workdir:
        asyncio.run(drill(args, Path(workdir)))


if __name__ == "__main__":
    main()
