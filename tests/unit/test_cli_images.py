"""`trainyard image` (J10) against a stand-in client: what it sends and prints, and bad input refused first."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from rich.progress import Progress

from client.cli.commands.images import _bar_progress
from libs.contracts.images import ImageRecord
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]

IMAGE = ImageRecord(name="team/torch", tag="2.13", digest="sha256:" + "5a2e07c4bd31" + "0" * 52, format="oci-archive",
                    size_bytes=65 * 2**20, boards=["cpu", "sim-a100"], training=False, description="torch",
                    registered_by="root", registered_at=datetime(2026, 11, 1, tzinfo=UTC))


def test_register_uploads_the_archive_for_its_boards_and_says_it_is_not_marked_yet(
        fake: FakeClient, tmp_path: Path) -> None:
    archive = tmp_path / "torch.oci.tar"
    archive.write_bytes(b"archive")
    fake.answers["register_image"] = IMAGE
    result = invoke("image", "register", "team/torch:2.13", "--archive", str(archive), "--board", "cpu",
                    "--board", "sim-a100", "--no-training", "--description", "torch")
    assert result.exit_code == 0, result.output
    [(method, args, kwargs)] = fake.calls
    assert (method, args) == ("register_image", ("team/torch:2.13", archive))
    assert (kwargs["boards"], kwargs["training"], kwargs["description"], kwargs["replace"]) == (
        ["cpu", "sim-a100"], False, "torch", False)
    assert "team/torch:2.13" in result.stdout and "cpu, sim-a100" in result.stdout
    assert "not marked for training jobs yet: trainyard image mark team/torch:2.13" in result.stdout


def test_a_bad_reference_or_a_missing_archive_is_refused_before_connecting(fake: FakeClient, tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(b"x")
    bad = invoke("image", "register", "Team/Torch", "--archive", str(archive), "--board", "cpu")
    assert bad.exit_code == 2 and "is not an image reference" in bad.output
    # A short path: the error box wraps a long one, maybe inside the words looked for.
    missing = invoke("image", "register", "team/torch:1", "--archive", "/nonexistent/a.tar", "--board", "cpu")
    assert missing.exit_code == 2 and "'/nonexistent/a.tar' does not" in missing.output
    assert fake.calls == []


def test_list_is_a_table_and_show_has_the_full_digest(fake: FakeClient) -> None:
    fake.answers["images"] = [IMAGE]
    listed = invoke("image", "list")
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()
    assert header.split() == ["IMAGE", "BOARDS", "TRAINING", "FORMAT", "SIZE", "DIGEST", "DESCRIPTION"]
    assert row.split() == ["team/torch:2.13", "cpu,", "sim-a100", "no", "oci-archive", "65.0", "MiB", "5a2e07c4bd31",
                           "torch"]
    shown = invoke("image", "show", "team/torch:2.13")
    assert IMAGE.digest in shown.stdout and "not marked (jobs may not use it)" in shown.stdout
    fake.answers["images"] = []
    assert "no images are registered" in invoke("image", "list").stdout


def test_the_upload_bar_starts_at_what_an_earlier_upload_left_without_counting_it_as_speed() -> None:
    with Progress(disable=True) as bars:
        task = bars.add_task("upload", total=100 * 2**20)
        update = _bar_progress(bars, task)
        update(60 * 2**20, 100 * 2**20)  # held by the scheduler already
        [state] = bars.tasks
        assert state.completed == 60 * 2**20 and not state._progress  # no sample of sending speed
        update(61 * 2**20, 100 * 2**20)
        assert state.completed == 61 * 2**20
        assert [sample.completed for sample in state._progress] == [2**20]  # what was sent now
