"""trainyard-drop (agent/isolation/drop.c), the program a root agent's sandbox runs first to become the job's user:
what the job is left with, and what it refuses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from agent.isolation.sandbox import built_drop_program

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")


@pytest.fixture(scope="module")
def program() -> str:
    found = built_drop_program(sys.executable)
    if found is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here: jobs drop with setpriv")
    assert found is not None, "make install builds .venv/bin/trainyard-drop where a C compiler is"
    return found


def status_of(program: str, uid: str) -> dict[str, str]:
    done = subprocess.run([program, uid, "cat", "/proc/self/status"], capture_output=True, text=True, check=True)
    return dict(line.split(":\t", 1) for line in done.stdout.splitlines() if ":\t" in line)


def test_the_command_runs_as_the_user_with_no_group_capability_or_way_back(program: str) -> None:
    status = status_of(program, "1000123")
    assert status["Uid"].split() == ["1000123"] * 4 and status["Gid"].split() == ["1000123"] * 4
    assert status["Groups"].strip() == ""
    for kind in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[kind].strip() == "0000000000000000", kind
    assert status["NoNewPrivs"].strip() == "1"


@pytest.mark.parametrize("uid", ["0", "-5", "12x", "", "4294967295", "99999999999999999999"])
def test_a_user_that_is_not_one_is_refused_and_nothing_runs(program: str, uid: str, tmp_path: os.PathLike[str]) -> None:
    marker = os.path.join(tmp_path, "ran")
    done = subprocess.run([program, uid, "touch", marker], capture_output=True, text=True, check=False)
    assert done.returncode == 125 and "is not a user id" in done.stderr
    assert not os.path.exists(marker)


def test_a_command_that_is_not_there_or_cannot_run_says_so_as_a_shell_does(program: str,
                                                                          tmp_path: os.PathLike[str]) -> None:
    # On a PATH the user may search (a folder it may not enter makes it 126, as it does for setpriv).
    missing = subprocess.run([program, "1000123", "no-such-command-here"], capture_output=True, text=True,
                             check=False, env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 127 and "no-such-command-here" in missing.stderr
    plain = os.path.join(tmp_path, "not-executable")
    with open(plain, "w") as file:
        file.write("#!/bin/sh\n")
    os.chmod(tmp_path, 0o755)
    denied = subprocess.run([program, "1000123", plain], capture_output=True, text=True, check=False)
    assert denied.returncode == 126


def test_without_a_command_it_says_how_it_is_used(program: str) -> None:
    done = subprocess.run([program, "1000123"], capture_output=True, text=True, check=False)
    assert done.returncode == 125 and "usage" in done.stderr


def test_a_devpts_that_cannot_be_mounted_stops_it_before_anything_runs(program: str,
                                                                       tmp_path: os.PathLike[str]) -> None:
    # (Mounted, it is the sandbox's own: tests/integration/test_sandbox_mounts.py looks at one in a sandbox.)
    marker = os.path.join(tmp_path, "ran")
    done = subprocess.run([program, "--devpts", os.path.join(tmp_path, "no-such-folder"), "1000123", "touch", marker],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 125 and "mounting a devpts of the sandbox's own failed" in done.stderr
    assert not os.path.exists(marker)
