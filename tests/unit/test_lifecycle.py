"""Lifecycle scripts around a node's command (J18): order, exit codes and what the log says."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from libs.contracts.cluster import Flavor
from libs.contracts.events import Placement
from libs.contracts.jobspec import AlgorithmRef, JobSpec, LifecycleScripts, OutputRef
from services.launcher.planner import plan_launch


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.lifecycle", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def py(code: str) -> str:
    return f"{sys.executable} -c {code!r}"


def test_scripts_run_before_and_after_and_see_the_exit_code() -> None:
    before = py("print('warming up')")
    after = py("import os; print('ended with', os.environ['TRAINYARD_EXIT_CODE'])")
    done = run("--before-start", before, "--after-end", after,
               "--", sys.executable, "-c", "print('training'); raise SystemExit(3)")
    assert done.returncode == 3
    assert done.stdout.splitlines() == [f"[trainyard] lifecycle before_start: {before}", "warming up", "training",
                                        f"[trainyard] lifecycle after_end: {after}", "ended with 3"]


def test_a_failing_before_start_keeps_the_command_from_running() -> None:
    done = run("--before-start", py("raise SystemExit(7)"), "--", sys.executable, "-c", "print('training')")
    assert done.returncode == 7
    assert "training" not in done.stdout
    assert "before_start failed with exit code 7; the run command was not started" in done.stdout


@pytest.mark.parametrize(("command_code", "expected"), [(0, 5), (2, 2)])
def test_a_failing_after_end_fails_only_a_successful_node(command_code: int, expected: int) -> None:
    done = run("--after-end", py("raise SystemExit(5)"),
               "--", sys.executable, "-c", f"raise SystemExit({command_code})")
    assert done.returncode == expected
    assert "after_end failed with exit code 5" in done.stdout


def test_the_planner_wraps_the_command_only_when_scripts_are_set() -> None:
    spec = JobSpec(name="j", mode="single-node", flavors=["cpu-1"], algorithm=AlgorithmRef(name="a"),
                   command="python3 train.py --lr 0.1", output=OutputRef(name="o"))
    place = [Placement(rank=0, node="n1", address="10.0.0.1", slots=1)]
    flavor = Flavor(name="cpu-1", cpus=1, memory_mib=1024)
    assert plan_launch(spec, flavor, place, ports={})[0].argv == ["python3", "train.py", "--lr", "0.1"]
    wrapped = msgspec.structs.replace(spec, lifecycle=LifecycleScripts(after_end="python3 upload.py"))
    assert plan_launch(wrapped, flavor, place, ports={})[0].argv == [
        "python3", "-m", "agent.lifecycle", "--after-end", "python3 upload.py", "--",
        "python3", "train.py", "--lr", "0.1"]
