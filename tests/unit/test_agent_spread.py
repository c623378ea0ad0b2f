"""The agent's job folders marked for their subfolders to be spread apart (agent/ranks/spread.py)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from agent.ranks.spread import spread_subfolders, subfolders_spread


def test_a_folder_on_a_file_system_with_the_attribute_is_marked_once_and_keeps_its_other_flags(tmp_path: Path) -> None:
    if not spread_subfolders(tmp_path):
        pytest.skip("the file system here has no such attribute")
    assert subfolders_spread(tmp_path)
    assert spread_subfolders(tmp_path)  # marked already: nothing changes
    flags = subprocess.run(["lsattr", "-d", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "T" in flags.split()[0]
    (tmp_path / "rank").mkdir()  # subfolders are made as before, and not marked themselves
    assert not subfolders_spread(tmp_path / "rank")


def test_a_file_system_without_it_or_a_missing_folder_changes_nothing() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:  # tmpfs
        assert not spread_subfolders(Path(folder))
        assert not subfolders_spread(Path(folder))
    assert not spread_subfolders(Path("/no/such/folder"))
