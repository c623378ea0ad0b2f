"""A node's folder goes once its process ended (SPEC J15), with the parents it leaves empty, and never
takes anything else along: not shared storage behind its links, not a folder outside the agent's jobs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.ranks.kept import (
    ENVIRONMENT_NAME,
    RemovalRefused,
    has_few_entries,
    job_of_folder,
    kept_roots,
    rank_of_folder,
    rank_root,
    remove_node_root,
)
from agent.ranks.process import RECORD_NAME, Record, read_records, write_record


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
    link.parent.mkdir(parents=True, exist_ok=True)
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


def test_a_folder_counts_as_small_by_all_its_entries_and_never_through_a_link(tmp_path: Path) -> None:
    folder = node_folder(tmp_path, 0)  # tmp/ and output.log
    assert has_few_entries(folder, limit=2)
    (folder / "tmp" / "scratch").write_text("x")  # an entry in a subfolder counts too
    assert not has_few_entries(folder, limit=2)
    assert has_few_entries(folder, limit=3)
    elsewhere = tmp_path / "big"
    elsewhere.mkdir()
    for index in range(10):
        (elsewhere / str(index)).write_text("x")
    (folder / "link").symlink_to(elsewhere, target_is_directory=True)  # one entry, not what it points to
    assert has_few_entries(folder, limit=4)
    assert has_few_entries(tmp_path / "gone")


def test_folders_of_the_layouts_before_are_still_found_and_removed(tmp_path: Path) -> None:
    """An agent started on the folders older ones left (`<job>/attempt-<a>.task-<t>.rank-<r>`, and before it
    `<job>/<attempt>/task-<t>/rank-<r>`) still adopts their processes, finds their kept environments, tells
    whose they are and removes them, the job's folder with its last rank's."""
    oldest = tmp_path / "jobs" / "job-1" / "1" / "task-0" / "rank-0"
    old = tmp_path / "jobs" / "job-1" / "attempt-2.task-1.rank-3"
    new = rank_root(tmp_path, "job-1", 3, 0, 0)
    assert new.parent == tmp_path / "jobs"  # no folder of the job's around its ranks' any more
    for folder, attempt in ((oldest, 1), (old, 2), (new, 3)):
        folder.mkdir(parents=True)
        write_record(folder, Record(job_id="job-1", attempt=attempt, rank=0, pid=1))
        (folder / ENVIRONMENT_NAME).write_text("{}")
    assert sorted(record.attempt for _, record in read_records(tmp_path)) == [1, 2, 3]
    assert sorted(kept_roots(tmp_path, "job-1")) == sorted([oldest, old, new])
    assert kept_roots(tmp_path, "job-2") == []
    assert [job_of_folder(folder) for folder in (oldest, old, new)] == ["job-1"] * 3
    assert [rank_of_folder(folder) for folder in (oldest, old, new)] == [None, (2, 1, 3), (3, 0, 0)]
    remove_node_root(tmp_path, oldest)
    assert not (tmp_path / "jobs" / "job-1" / "1").exists() and (old / RECORD_NAME).exists()
    remove_node_root(tmp_path, old)
    assert not (tmp_path / "jobs" / "job-1").exists() and (new / RECORD_NAME).exists()
    remove_node_root(tmp_path, new)
    assert list((tmp_path / "jobs").iterdir()) == []
