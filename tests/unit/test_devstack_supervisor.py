"""The local stack's supervisor: when it restarts a process that exited, and what `status` makes of
its records. Time is given, never waited for; processes are stand-ins."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack.processes import forget_stopped, stack_processes
from devstack.stack import ProcessSet
from devstack.supervisor import (
    Backoff,
    Lifecycle,
    Program,
    Supervisor,
    after_exit,
    due,
    platform_programs,
    restarted,
)

BACKOFF = Backoff(first=1.0, longest=30.0, steady=60.0)


def test_the_wait_doubles_while_a_process_keeps_failing_up_to_the_longest() -> None:
    waits, previous = [], None
    for _ in range(8):
        previous = BACKOFF.delay(previous, uptime=2.0)
        waits.append(previous)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_the_wait_starts_over_once_a_process_stayed_up_a_minute() -> None:
    assert BACKOFF.delay(30.0, uptime=59.0) == 30.0
    assert BACKOFF.delay(30.0, uptime=60.0) == 1.0
    assert BACKOFF.delay(30.0, uptime=3600.0) == 1.0


def test_a_process_is_due_for_a_restart_once_its_wait_is_over() -> None:
    life = after_exit(Lifecycle(started_at=100.0), exit_code=1, now=105.0, backoff=BACKOFF)
    assert (life.exit_code, life.restart_at) == (1, 106.0)
    assert not due(life, 105.9)
    assert due(life, 106.0)
    again = restarted(life, 106.0)
    assert (again.restarts, again.started_at, again.restart_at) == (1, 106.0, None)
    assert not due(again, 1000.0)  # running: nothing to restart


@dataclass
class StandIn:
    """A started process: `poll` says its exit code once the test ends it."""

    pid: int
    exit_code: int | None = None

    def poll(self) -> int | None:
        return self.exit_code

    def wait(self, timeout: float | None = None) -> int:
        return self.exit_code or 0


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Log:
    lines: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((event, fields))


@dataclass
class Starts:
    """Starts stand-ins for one program, with pids counting up, and records them."""

    run_dir: Path
    name: str
    started: list[StandIn] = field(default_factory=list)

    def __call__(self) -> Any:
        process = StandIn(pid=4000 + len(self.started))
        self.started.append(process)
        (self.run_dir / f"{self.name}.pid").write_text(str(process.pid))
        return process


def supervised(tmp_path: Path) -> tuple[Supervisor, Starts, Clock, Log]:
    starts, clock, log = Starts(tmp_path, "scheduler"), Clock(), Log()
    supervisor = Supervisor(tmp_path, [Program("scheduler", starts)], backoff=BACKOFF, clock=clock, log=log)
    supervisor.start_all()
    return supervisor, starts, clock, log


def test_a_process_that_exits_is_started_again_after_its_wait(tmp_path: Path) -> None:
    supervisor, starts, clock, log = supervised(tmp_path)
    starts.started[0].exit_code = 1
    clock.now += 5
    supervisor.tick()
    clock.now += 0.9
    supervisor.tick()
    assert len(starts.started) == 1  # still waiting its 1 s
    clock.now += 0.1
    supervisor.tick()
    assert len(starts.started) == 2
    assert [event for event, _ in log.lines] == ["supervisor.started", "supervisor.exited", "supervisor.restarted"]
    assert log.lines[1][1] | {"uptime_seconds": 5.0} == {"process": "scheduler", "pid": 4000, "exit_code": 1,
                                                          "uptime_seconds": 5.0, "restart_in_seconds": 1.0}
    assert log.lines[2][1] == {"process": "scheduler", "pid": 4001, "restarts": 1}


def test_a_process_failing_again_soon_waits_twice_as_long(tmp_path: Path) -> None:
    supervisor, starts, clock, log = supervised(tmp_path)
    for expected_wait in (1.0, 2.0, 4.0):
        starts.started[-1].exit_code = 1
        supervisor.tick()
        clock.now += expected_wait - 0.01
        supervisor.tick()
        clock.now += 0.01
        supervisor.tick()
    assert len(starts.started) == 4
    assert [fields["restart_in_seconds"] for event, fields in log.lines if event == "supervisor.exited"] == [
        1.0, 2.0, 4.0]


def test_the_state_file_follows_exits_and_restarts(tmp_path: Path) -> None:
    supervisor, starts, clock, _ = supervised(tmp_path)
    starts.started[0].exit_code = -9
    supervisor.tick()
    state = json.loads((tmp_path / "supervisor.json").read_text())
    assert state["pid"] == os.getpid()
    assert state["processes"]["scheduler"] | {"restart_at": None} == {
        "pid": None, "restarts": 0, "exit_code": -9, "restart_at": None}
    assert state["processes"]["scheduler"]["restart_at"] is not None
    clock.now += 1
    supervisor.tick()
    state = json.loads((tmp_path / "supervisor.json").read_text())
    assert state["processes"]["scheduler"] == {"pid": 4001, "restarts": 1, "exit_code": -9, "restart_at": None}


def test_a_start_that_fails_is_tried_again_later(tmp_path: Path) -> None:
    attempts: list[float] = []
    clock, log = Clock(), Log()

    def start() -> Any:
        attempts.append(clock.now)
        raise FileNotFoundError("no such program")

    supervisor = Supervisor(tmp_path, [Program("launcher", start)], backoff=BACKOFF, clock=clock, log=log)
    supervisor.start_all()
    for _ in range(4):
        clock.now += 1
        supervisor.tick()
    assert attempts == [1000.0, 1001.0, 1003.0]
    assert log.lines[0] == ("supervisor.start_failed", {"process": "launcher", "error": "no such program"})


# --- status ----------------------------------------------------------------------------------------------------


def write_stack(home: Path, processes: dict[str, Any], pids: dict[str, int]) -> None:
    run = home / "run"
    run.mkdir(parents=True)
    (run / "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "processes": processes}))
    for name, pid in pids.items():
        (run / f"{name}.pid").write_text(str(pid))


def test_status_lists_restarted_and_waiting_processes(tmp_path: Path) -> None:
    me, gone = os.getpid(), 2**22 + 1  # this test's process runs; no process has a pid above the kernel's limit
    write_stack(tmp_path, {
        "scheduler": {"pid": me, "restarts": 2, "exit_code": -9, "restart_at": None},
        "agent-node-a": {"pid": None, "restarts": 3, "exit_code": 1, "restart_at": 5004.2},
    }, {"supervisor": me, "scheduler": me, "agent-node-a": gone, "nats": me})
    listed = {p.name: (p.running, p.detail) for p in stack_processes(tmp_path, now=5000.0)}
    assert list(listed) == ["supervisor", "scheduler", "agent-node-a", "nats"]
    assert listed["scheduler"] == (True, f"pid {me}, restarted 2 times, last exit code -9")
    assert listed["agent-node-a"] == (False, "exit code 1, restarting in 4s, restarted 3 times")
    assert listed["supervisor"] == (True, f"pid {me}")


def test_status_says_when_the_supervisor_is_gone(tmp_path: Path) -> None:
    gone = 2**22 + 1
    write_stack(tmp_path, {"launcher": {"pid": None, "restarts": 0, "exit_code": 1, "restart_at": None}},
                {"supervisor": gone, "launcher": gone})
    listed = {p.name: (p.running, p.detail) for p in stack_processes(tmp_path, now=0.0)}
    assert listed["supervisor"][0] is False
    assert "nothing restarts the others" in listed["supervisor"][1]
    assert listed["launcher"] == (False, "exit code 1")


def test_status_of_a_stack_that_is_not_running_lists_nothing(tmp_path: Path) -> None:
    assert stack_processes(tmp_path) == []


def test_up_forgets_the_records_of_a_stack_that_ended_without_down(tmp_path: Path) -> None:
    gone = 2**22 + 1
    write_stack(tmp_path, {"scheduler": {"pid": gone, "restarts": 0, "exit_code": None, "restart_at": None}},
                {"supervisor": gone, "scheduler": gone, "nats": os.getpid()})
    forget_stopped(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["nats.pid"]


def test_replicas_run_each_service_that_many_times_and_each_agent_once(tmp_path: Path) -> None:
    cluster = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"
    processes = ProcessSet(tmp_path, {})

    names = [p.name for p in platform_programs(processes, cluster, tmp_path / "agents", replicas=2)]

    assert names == ["scheduler", "scheduler-2", "launcher", "launcher-2", "monitor", "monitor-2", "autoscaler",
                     "autoscaler-2", "agent-node-a", "agent-node-b"]
