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
