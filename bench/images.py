"""Jobs in images (SPEC J10): how long a job takes from submit to its process starting, without an image, in
an image its node must unpack first (cold), and in one its node has unpacked already (warm).

    python -m bench.images [--runs 3] [--format oci-archive|docker-archive|rootfs]

Runs the whole stack with the bubblewrap backend, registers the test image (Debian bookworm minbase with
python3, tests/support/testimage.py: built once per machine, minutes the first time), and times one
single-node job of each kind per run on node-a. A cold start follows the removal of node-a's unpacked copy.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from pathlib import Path

from agent.isolation.workspace import BACKEND_VARIABLE, bwrap_problem
from bench.datacache import start_seconds
from bench.servers import bench_servers
from client.api import TrainyardClient
from devstack.harness import Stack
from devstack.stack import REPO_ROOT
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from tests.support.testimage import test_image, test_image_problem

IMAGE = "bench/bookworm:1"


def job(name: str, image: str | None) -> JobSpec:
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command="true",
                   node_names=["node-a"], output=OutputRef(name=name), image=image)


def forget_unpacked(home: Path) -> None:
    """Remove every node's unpacked images (no job uses them between runs)."""
    for entries in home.rglob("images/entries"):
        shutil.rmtree(entries)


async def measure(runs: int, image_format: str) -> dict[str, list[float]]:
    images = test_image()
    archive = {"oci-archive": images.oci_archive, "docker-archive": images.docker_archive,
               "rootfs": images.rootfs_tar}[image_format]
    found: dict[str, list[float]] = {"no image": [], "cold": [], "warm": []}
    async with bench_servers("bench_images") as servers:
        stack = Stack(servers.home / "stack", None, servers.database_url, connect=TrainyardClient.open,
                      algorithms=REPO_ROOT / "tests" / "e2e" / "algorithms", timings={},
                      env={BACKEND_VARIABLE: "bwrap"})
        try:
            api = await stack.up()
            began = time.perf_counter()
            record = await api.register_image(IMAGE, archive, boards=["cpu"])
            seconds = time.perf_counter() - began
            print(f"registered {IMAGE}: {record.format}, {record.size_bytes / 2**20:.0f} MiB uploaded and checked in "
                  f"{seconds:.1f} s ({record.size_bytes / 2**20 / seconds:.0f} MiB/s)", flush=True)
            for run in range(runs):
                found["no image"].append(await start_seconds(api, stack, job(f"plain-{run}", None)))
                forget_unpacked(stack.home)
                found["cold"].append(await start_seconds(api, stack, job(f"cold-{run}", IMAGE)))
                found["warm"].append(await start_seconds(api, stack, job(f"warm-{run}", IMAGE)))
                print(f"run {run + 1}: " + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in found.items()),
                      flush=True)
        finally:
            await stack.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--format", default="oci-archive", choices=("oci-archive", "docker-archive", "rootfs"))
    args = parser.parse_args()
    for problem in (bwrap_problem(), test_image_problem()):
        if problem is not None:
            raise SystemExit(f"jobs in images cannot run here: {problem}")
    found = asyncio.run(measure(args.runs, args.format))
    print(f"\nsubmit to process start on one node, {args.runs} runs, image as {args.format}, median (min-max):")
    for name, values in found.items():
        print(f"  {name:8} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
