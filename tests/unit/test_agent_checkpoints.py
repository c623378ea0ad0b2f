"""Checkpoint folders per attempt (agent/isolation/checkpoints.py): a new attempt starts from what the last one saved,
and a process of the old attempt that still runs can no longer change what the new one resumes from."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.isolation.checkpoints import SEEDED_FROM, prepare_checkpoints


def saved(folder: Path, name: str, content: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(content)


def test_the_first_attempt_starts_with_an_empty_folder(tmp_path: Path) -> None:
    assert prepare_checkpoints(tmp_path / "job-1" / "attempt-1") is None
    assert list((tmp_path / "job-1" / "attempt-1").iterdir()) == []


def test_a_new_attempt_resumes_from_a_copy_the_old_attempt_cannot_write_into(tmp_path: Path) -> None:
    saved(tmp_path / "attempt-1", "step.pt", "step 40")

    assert prepare_checkpoints(tmp_path / "attempt-2") == tmp_path / "attempt-1"

    assert (tmp_path / "attempt-2" / "step.pt").read_text() == "step 40"
    assert (tmp_path / "attempt-2" / SEEDED_FROM).read_text() == "attempt-1\n"
    # The old attempt's process came back from a lost node and saves again: only into its own folder.
    saved(tmp_path / "attempt-1", "step.pt", "step 41, stale")
    assert (tmp_path / "attempt-2" / "step.pt").read_text() == "step 40"


def test_the_newest_earlier_attempt_is_copied_and_older_ones_go(tmp_path: Path) -> None:
    saved(tmp_path / "attempt-1", "step.pt", "step 10")
    saved(tmp_path / "attempt-2", "step.pt", "step 20")

    assert prepare_checkpoints(tmp_path / "attempt-3") == tmp_path / "attempt-2"

    assert (tmp_path / "attempt-3" / "step.pt").read_text() == "step 20"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-2", "attempt-3"]


def test_a_folder_in_place_is_left_as_it_is(tmp_path: Path) -> None:
    saved(tmp_path / "attempt-1", "step.pt", "step 10")
    saved(tmp_path / "attempt-2", "step.pt", "step 25, saved by this attempt")

    assert prepare_checkpoints(tmp_path / "attempt-2") is None  # a rank started later, or again
    assert (tmp_path / "attempt-2" / "step.pt").read_text() == "step 25, saved by this attempt"


def test_every_rank_preparing_at_once_gives_one_folder(tmp_path: Path) -> None:
    saved(tmp_path / "attempt-1", "step.pt", "x" * 100_000)

    with ThreadPoolExecutor(8) as ranks:
        list(ranks.map(lambda _: prepare_checkpoints(tmp_path / "attempt-2"), range(8)))

    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-1", "attempt-2"]  # no copy left behind
    assert sorted(p.name for p in (tmp_path / "attempt-2").iterdir()) == [SEEDED_FROM, "step.pt"]
    assert (tmp_path / "attempt-2" / "step.pt").read_text() == "x" * 100_000
