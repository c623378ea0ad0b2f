"""The local stack's supervisor: it owns the services and node agents that `make up` runs.

`python -m devstack up` starts this one small process; it starts the four services and one
agent per node, and restarts any of them that exits on its own, after a wait that starts at 1 s,
doubles up to 30 s while the process keeps failing, and drops back to 1 s once it stayed up a
minute. Each exit and restart is logged (logs/supervisor.log). Every start writes the process's pid
to run/<name>.pid, and run/supervisor.json says how each one fares (pid, restarts, last exit code,
when the next start is due), so `status` and `down` see every process, restarted ones included.
SIGTERM (`down`) stops them all, then the supervisor itself.

The decisions are pure functions of the time they are given (`Backoff.delay`, `after_exit`,
`restarted`, `due`); `Supervisor.tick` applies them to real processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from devstack.stack import (
    SERVICES,
    ProcessSet,
    end_platform,
    start_agent,
    start_gateway,
    start_service,
)
from libs.contracts.cluster import ClusterConfig
from libs.localstack import home_dir, read_stack_env

STATE_FILE = "supervisor.json"
PID_NAME = "supervisor"
EXIT_CODE_NOT_STARTED = 127  # what a start that raised (a missing executable) counts as


@dataclass(frozen=True)
class Backoff:
    """How long to wait before restarting a process that exited."""

    first: float = 1.0
    longest: float = 30.0
    steady: float = 60.0  # a process up this long counts as healthy again: the wait starts over

    def delay(self, previous: float | None, uptime: float) -> float:
        """The wait after an exit `uptime` seconds after the start; `previous` is the wait before that
        start (None: it was the first)."""
        if previous is None or uptime >= self.steady:
            return self.first
        return min(previous * 2, self.longest)


@dataclass(frozen=True)
class Lifecycle:
    """What the supervisor knows of one process across its starts."""

    started_at: float
    restarts: int = 0
    delay: float | None = None  # the wait before its latest start
    restart_at: float | None = None  # set while it is down
    exit_code: int | None = None  # of its latest exit


def after_exit(life: Lifecycle, exit_code: int, now: float, backoff: Backoff) -> Lifecycle:
    delay = backoff.delay(life.delay, now - life.started_at)
    return replace(life, delay=delay, restart_at=now + delay, exit_code=exit_code)


def restarted(life: Lifecycle, now: float) -> Lifecycle:
    return replace(life, started_at=now, restarts=life.restarts + 1, restart_at=None)


def due(life: Lifecycle, now: float) -> bool:
    return life.restart_at is not None and now >= life.restart_at


@dataclass(frozen=True)
class Program:
    """A process to keep running: its name (logs/<name>.log, run/<name>.pid) and how to start it."""

    name: str
    start: Callable[[], subprocess.Popen[bytes]]


def _default_log() -> Any:
    from libs.telemetry.logs import get_logger

    return get_logger(__name__)


class Supervisor:
    """Keeps `programs` running; `clock` is monotonic seconds."""

    def __init__(self, run_dir: Path, programs: Sequence[Program], *, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic, log: Any = None) -> None:
        self.run_dir = run_dir
        self.programs = list(programs)
        self.backoff = backoff
        self.clock = clock
        self.log = log or _default_log()
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.lives: dict[str, Lifecycle] = {}

    def start_all(self) -> None:
        now = self.clock()
        for program in self.programs:
            self.lives[program.name] = self._start(program, Lifecycle(started_at=now), now)
        self.record()

    def tick(self) -> None:
        """Note the exits since the last tick and start again what is due."""
        now = self.clock()
        changed = False
        for program in self.programs:
            life, process = self.lives[program.name], self.children.get(program.name)
            if process is not None and (code := process.poll()) is not None:
                del self.children[program.name]
                life = after_exit(life, code, now, self.backoff)
                self.log.warning("supervisor.exited", process=program.name, pid=process.pid, exit_code=code,
                                 uptime_seconds=round(now - life.started_at, 1), restart_in_seconds=life.delay)
                changed = True
            elif process is None and due(life, now):
                life = self._start(program, restarted(life, now), now)
                changed = True
            self.lives[program.name] = life
        if changed:
            self.record()

    def _start(self, program: Program, life: Lifecycle, now: float) -> Lifecycle:
        try:
            process = program.start()
        except OSError as exc:
            self.log.error("supervisor.start_failed", process=program.name, error=str(exc))
            return after_exit(life, EXIT_CODE_NOT_STARTED, now, self.backoff)
        self.children[program.name] = process
        event = "supervisor.restarted" if life.restarts else "supervisor.started"
        self.log.info(event, process=program.name, pid=process.pid, restarts=life.restarts)
        return life

    def record(self) -> None:
        """Write how every process fares to run/supervisor.json (read by `status`)."""
        now, wall = self.clock(), time.time()
        processes = {
            name: {"pid": self.children[name].pid if name in self.children else None,
                   "restarts": life.restarts, "exit_code": life.exit_code,
                   "restart_at": wall + (life.restart_at - now) if life.restart_at is not None else None}
            for name, life in self.lives.items()}
        state = self.run_dir / STATE_FILE
        partial = state.with_suffix(".tmp")
        partial.write_text(json.dumps({"pid": os.getpid(), "processes": processes}, indent=1))
        partial.replace(state)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after `timeout`; forget their pid files."""
        for process in self.children.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.children.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.children.clear()
        for program in self.programs:
            (self.run_dir / f"{program.name}.pid").unlink(missing_ok=True)
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)


def supervise(run_dir: Path, programs: Sequence[Program], *, backoff: Backoff = Backoff(),
              poll_seconds: float = 0.2, after_stop: Callable[[], None] | None = None) -> None:
    """Run `programs` under a supervisor until SIGTERM or SIGINT, then stop them and call `after_stop`."""
    stopping: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"{PID_NAME}.pid").write_text(str(os.getpid()))
    supervisor = Supervisor(run_dir, programs, backoff=backoff)
    try:
        supervisor.start_all()
        while not stopping:
            time.sleep(poll_seconds)
            supervisor.tick()
        supervisor.log.info("supervisor.stopping", processes=sorted(supervisor.children))
    finally:
        supervisor.stop()
        if after_stop is not None:
            after_stop()
        (run_dir / f"{PID_NAME}.pid").unlink(missing_ok=True)


def instance_names(service: str, replicas: int) -> list[str]:
    """The processes of a service run `replicas` times: `scheduler`, `scheduler-2`, …"""
    return [service if number == 1 else f"{service}-{number}" for number in range(1, replicas + 1)]


def platform_programs(processes: ProcessSet, cluster: Path, agents_root: Path, replicas: int = 1,
                      gateway: str | None = None) -> list[Program]:
    """The four services, each `replicas` times (one acts, the others stand by: libs/eventstore/lease.py),
    one agent per node of the cluster config (each agent start issues it a new node credential), and the gateway
    on the address `gateway` when given."""
    def service(name: str, instance: str) -> Program:
        return Program(instance, lambda: start_service(processes, name, instance))

    def agent(node: str) -> Program:
        return Program(f"agent-{node}", lambda: start_agent(processes, node, cluster, agents_root))

    services = [service(name, instance) for name in SERVICES for instance in instance_names(name, replicas)]
    http = [Program("gateway", lambda: start_gateway(processes, gateway))] if gateway else []
    return [*services, *http, *(agent(n.name) for n in ClusterConfig.load(cluster).nodes)]


def main() -> None:
    from libs.telemetry.logs import configure_logging

    parser = argparse.ArgumentParser(description="Keep the local stack's services and node agents running.")
    parser.add_argument("--home", type=Path, default=None, help="the stack's folder (default: $TRAINYARD_HOME)")
    parser.add_argument("--cluster", type=Path, required=True, help="the cluster config naming the nodes")
    parser.add_argument("--replicas", type=int, default=1, help="processes per service (one acts, the others stand by)")
    parser.add_argument("--gateway", default=None,
                        help="the address the gateway (the HTTP API) serves on (default: it is not run)")
    args = parser.parse_args()
    configure_logging("supervisor")
    home = (args.home or home_dir()).resolve()
    processes = ProcessSet(home, read_stack_env(home))  # what `up` wrote for every process
    nodes = [node.name for node in ClusterConfig.load(args.cluster).nodes]
    # Stopped agents leave their jobs running for the next one; a stack that goes down ends them.
    supervise(home / "run", platform_programs(processes, args.cluster, home / "agents", args.replicas, args.gateway),
              after_stop=lambda: end_platform(nodes, home))


if __name__ == "__main__":
    main()
