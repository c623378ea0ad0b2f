"""trainyard-bwrap, Debian's bubblewrap as `make install` builds it (deploy/local/build-bwrap.sh): the program every
job's sandbox starts, where it was built, and the system's bwrap elsewhere. The sandboxes it makes are tested where
jobs run (test_job_isolation.py, test_sandbox_mounts.py and the end-to-end tests run it); here, which one an agent
runs and that it is the same bubblewrap, started without a dynamic loader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from agent.isolation.workspace import BUILT_BWRAP, bwrap_program

BUILT = Path(sys.executable).with_name(BUILT_BWRAP)


@pytest.fixture(scope="module")
def built() -> Path:
    if not BUILT.exists() and shutil.which("musl-gcc") is None:
        pytest.skip("no musl-gcc here: agents run the system's bwrap")
    assert BUILT.exists(), ("make install builds .venv/bin/trainyard-bwrap where musl-gcc is: run it, and see what "
                            "deploy/local/build-bwrap.sh says")
    return BUILT


def has_interpreter(program: Path) -> bool:
    """Whether the ELF file names a dynamic loader (a PT_INTERP program header): a dynamically linked program."""
    data = program.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, "a 64-bit ELF file"
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"
    offset, size, count = (int.from_bytes(data[at:at + width], order) for at, width in ((32, 8), (54, 2), (56, 2)))
    return any(int.from_bytes(data[offset + i * size:offset + i * size + 4], order) == 3 for i in range(count))


def test_agents_start_sandboxes_with_the_built_bwrap(built: Path) -> None:
    assert bwrap_program(sys.executable) == str(built)


def test_it_is_debians_bubblewrap_started_without_a_dynamic_loader(built: Path) -> None:
    ours = subprocess.run([str(built), "--version"], capture_output=True, text=True, check=True).stdout
    assert ours.strip() == "bubblewrap 0.8.0"
    if (system := shutil.which("bwrap")) is not None:
        assert subprocess.run([system, "--version"], capture_output=True, text=True, check=True).stdout == ours
        assert has_interpreter(Path(system))
    assert not has_interpreter(built)


def test_without_a_built_one_agents_run_the_systems(tmp_path: Path) -> None:
    python = tmp_path / "python"  # an interpreter with nothing built beside it
    assert bwrap_program(str(python)) == shutil.which("bwrap")
    (tmp_path / BUILT_BWRAP).write_text("")  # there, but not a program
    assert bwrap_program(str(python)) == shutil.which("bwrap")


def test_a_sandbox_far_larger_than_a_jobs_is_made_whole(built: Path, tmp_path: Path) -> None:
    """The built bwrap has an allocator of its own (deploy/local/bwrap-arena.c): here it holds megabytes of
    arguments, read through a file descriptor and grown as they are read, and the mount table read again for each
    of a hundred binds, every folder and bind where it was asked for."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "mark").write_text("here\n")
    # Some 1.4 MB of arguments (bwrap takes 9,000 at most): folders of long names.
    folders = [f"/many/{i:04}{'f' * 240}/{'g' * 240}" for i in range(2_900)]
    binds = [f"/bound/{i}" for i in range(100)]
    args = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc"]
    args += [word for folder in folders for word in ("--dir", folder)]
    args += [word for bind in binds for word in ("--ro-bind", str(source), bind)]
    (tmp_path / "args").write_bytes(b"".join(arg.encode() + b"\0" for arg in args))
    check = ("ls /many | wc -l; cat /bound/0/mark /bound/99/mark; "
             "grep -c ' /bound/' /proc/self/mountinfo")
    with (tmp_path / "args").open("rb") as given:
        done = subprocess.run([str(built), "--args", str(given.fileno()), "--unshare-pid", "sh", "-c", check],
                              pass_fds=(given.fileno(),), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2900", "here", "here", "100"]
