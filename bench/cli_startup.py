"""How long the `trainyard` command line takes to start, in wall seconds per process.

    python -m bench.cli_startup [--runs 10] [--warmup 1] [--compile]

Each row starts a fresh process RUNS times (after WARMUP runs not counted) and times it from start to
exit: the interpreter alone (the floor), importing `client.cli`, `trainyard --help`, `trainyard list
--help`, and `trainyard list` up to the moment it connects to NATS (the connection is replaced by an
immediate exit, so no stack is needed and no retry is waited for). `trainyard` runs as
`python -m client.cli`, so the rows measure the checkout the benchmark is run from.

Python's bytecode caches are kept in a temporary folder (PYTHONPYCACHEPREFIX), written by the warm-up
runs, as an installed CLI has them; with --compile no cache is used and every run compiles the
project's modules, as under PYTHONDONTWRITEBYTECODE.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# `trainyard list` until TrainyardClient.open connects: the stand-in ends the process right there.
LIST_UNTIL_CONNECT = """
import os, sys
import client.api

async def connect_once(url: str, name: str) -> None:
    os._exit(0)

client.api.connect_once = connect_once
sys.argv = ["trainyard", "list"]
from client.cli import main
main()
"""


def commands() -> list[tuple[str, list[str]]]:
    python = sys.executable
    trainyard = [python, "-m", "client.cli"]
    return [("python -c pass", [python, "-c", "pass"]),
            ("import client.cli", [python, "-c", "import client.cli"]),
            ("trainyard --help", [*trainyard, "--help"]),
            ("trainyard list --help", [*trainyard, "list", "--help"]),
            ("trainyard list, until it connects", [python, "-c", LIST_UNTIL_CONNECT])]


def run_once(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
    elapsed = time.perf_counter() - started
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({finished.returncode}): {finished.stderr.decode()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="runs of each command not counted (caches)")
    parser.add_argument("--compile", action="store_true", help="no bytecode cache: compile in every run")
    args = parser.parse_args()
    # Never a running stack's: the last row must not reach one.
    env = {**os.environ, "NATS_URL": "nats://127.0.0.1:1", "COLUMNS": "200"}
    with tempfile.TemporaryDirectory(prefix="cli-startup-pycache-") as pycache:
        if args.compile:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = pycache  # not in the source tree
        print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; wall seconds "
              f"per process, {args.runs} runs after {args.warmup} warm-up, "
              + ("compiling every run" if args.compile else "bytecode cached"))
        print(f"{'command':<36}{'min':>8}{'median':>8}{'max':>8}")
        for label, command in commands():
            for _ in range(args.warmup):
                run_once(command, env)
            timings = [run_once(command, env) for _ in range(args.runs)]
            print(f"{label:<36}{min(timings):>8.3f}{statistics.median(timings):>8.3f}{max(timings):>8.3f}")


if __name__ == "__main__":
    main()
