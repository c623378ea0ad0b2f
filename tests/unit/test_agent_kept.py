"""A node's folder goes once its process ended (SPEC J15), with the parents it leaves empty, and never
takes anything else along: not shared storage behind its links, not a folder outside the agent's jobs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.kept import RemovalRefused, rank_root, remove_node_root


def node_folder(root: Path, rank: int) -> Path:
    folder = rank_root(root, "job-1", 1, 0, rank)
    (folder / "tmp").mkdir(parents=True)
    (folder / "output.log").write_text("hello\n")
    return folder


def test_a_node_folder_goes_with_the_parents_it_leaves_empty(tmp_path: Path) -> None:
    first, second = node_folder(tmp_path, 0), node_folder(tmp_path, 1)
    remove_node_root(tmp_path, first)
    assert not first.exists() and second.exists()  # the other rank's folder and so their parents stay
    remove_node_root(tmp_path, second)
    assert list((tmp_path / "jobs").iterdir()) == []  # the job's folders are gone, the agent's stays
    remove_node_root(tmp_path, second)  # gone already: nothing to do


def test_removal_never_follows_a_link_into_shared_storage(tmp_path: Path) -> None:
    storage = tmp_path / "storage" / "algorithms" / "demo"
    storage.mkdir(parents=True)
    (storage / "train.py").write_text("print('hi')\n")
    folder = node_folder(tmp_path / "agent", 0)
    (folder / "workspace").mkdir()
    (folder / "workspace" / "algorithm").symlink_to(storage, target_is_directory=True)
    remove_node_root(tmp_path / "agent", folder)
    assert not folder.exists()
    assert (storage / "train.py").read_text() == "print('hi')\n"


def test_a_link_or_a_folder_outside_the_jobs_folder_is_refused(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "agent", tmp_path / "elsewhere"
    folder = node_folder(root, 0)
    elsewhere.mkdir()
    link = rank_root(root, "job-2", 1, 0, 0)
    link.parent.mkdir(parents=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    for refused in (link, elsewhere, root / "jobs", root / "jobs" / ".." / ".." / "elsewhere"):
        with pytest.raises(RemovalRefused):
            remove_node_root(root, refused)
    assert elsewhere.is_dir() and folder.is_dir()


def test_a_folder_holding_a_mount_point_is_left_in_place(tmp_path: Path) -> None:
    folder = node_folder(tmp_path, 0)
    mounted = folder / "tmp" / "scratch"
    mounted.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(mounted)], capture_output=True, check=False).returncode:
        pytest.skip("cannot mount here")
    try:
        (mounted / "data").write_text("on another file system")
        with pytest.raises(RemovalRefused, match="is a mount point"):
            remove_node_root(tmp_path, folder)
        assert (mounted / "data").read_text() == "on another file system"
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
