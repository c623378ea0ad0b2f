"""How fast a standby takes a service over: the scheduler, active and standby, one killed in turn.

    python -m bench.failover [--drills 5] [--service scheduler]

Starts NATS and PostgreSQL (as the tests do), then two processes of the service on the same database
(libs/eventstore/lease.py: one acts, the other waits). Each drill stops the active one, with kill -9
(`crash`: the standby must wait for the lease to run out, TRAINYARD_LEASE_SECONDS) or SIGTERM
(`stop`: the lease is given up as it stops), and measures from that moment until a request is
answered again (`trainyard whoami`, answered by the scheduler). The stopped process is started again
as the next standby. Prints each drill and the minimum, median and maximum per kind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.servers import bench_servers
from client.api import TrainyardClient
from libs.auth import issue_token, new_secret
from libs.contracts.identity import Identity
from libs.messaging.rpc import ServiceUnavailable

ROOT = Path(__file__).resolve().parents[1]


def start(service: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", f"services.{service}"], env=env, cwd=ROOT,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


async def answered(client: TrainyardClient, timeout: float = 60) -> float:
    """Seconds until the service answers a request."""
    began = time.monotonic()
    async with asyncio.timeout(timeout):
        while True:
            try:
                await asyncio.wait_for(client.whoami(), 0.5)
                return time.monotonic() - began
            except (ServiceUnavailable, TimeoutError):
                await asyncio.sleep(0.02)


def active_of(processes: list[subprocess.Popen[bytes]], logs: list[Path]) -> int:
    """Which process logged last that it became active."""
    latest = [log.read_text(errors="replace").rfind('"service.active"') for log in logs]
    return max(range(len(processes)), key=lambda i: latest[i])


async def drills(service: str, count: int, env: dict[str, str], home: Path, token: str) -> dict[str, list[float]]:
    logs = [home / f"{service}-{i}.log" for i in range(2)]
    processes = [start(service, env, logs[0])]
    client = await TrainyardClient.open(env["NATS_URL"], token=token)
    await answered(client, 120)
    processes.append(start(service, env, logs[1]))
    await asyncio.sleep(3)  # the second one is up and waiting for the lease
    found: dict[str, list[float]] = {"crash": [], "stop": []}
    try:
        for number in range(count):
            for kind in ("crash", "stop"):
                which = active_of(processes, logs)
                for log in logs:  # the next "service.active" is the takeover's
                    log.write_text("")
                began = time.monotonic()
                processes[which].send_signal(signal.SIGKILL if kind == "crash" else signal.SIGTERM)
                processes[which].wait(timeout=30)
                await answered(client)
                seconds = time.monotonic() - began
                found[kind].append(seconds)
                print(f"drill {number + 1} {kind}: answered again after {seconds:.2f} s", flush=True)
                processes[which] = start(service, env, logs[which])
                await asyncio.sleep(3)
    finally:
        await client.close()
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=30)
    return found


async def main_async(args: argparse.Namespace) -> None:
    async with bench_servers("failover") as servers:
        secret = new_secret()
        env = {**os.environ, "NATS_URL": servers.nats_url, "DATABASE_URL": servers.database_url,
               "TRAINYARD_AUTH_SECRET": secret, "TRAINYARD_CLUSTER": str(ROOT / "deploy" / "local" / "cluster.yaml")}
        token = issue_token(secret, Identity(user="root", projects=["default"], admin=True))
        found = await drills(args.service, args.drills, env, servers.home, token)
    lease = os.environ.get("TRAINYARD_LEASE_SECONDS", "5")
    print(f"\n{args.service}, lease {lease} s: seconds until it answered again")
    print(f"{'stopped by':<12}{'min':>8}{'median':>8}{'max':>8}")
    for kind, values in found.items():
        print(f"{kind:<12}{min(values):>8.2f}{statistics.median(values):>8.2f}{max(values):>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__)
    parser.add_argument("--drills", type=int, default=5)
    parser.add_argument("--service", default="scheduler", choices=["scheduler"])
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
