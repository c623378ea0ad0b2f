"""J10 through the client on real NATS and PostgreSQL: administrators register images (uploaded in chunks to
shared storage), mark and delete them; a job's image must be registered, marked for training and built for
the boards of its flavors, and a job keeps the image it was accepted with."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from libs.contracts.events import JobSubmitted
from libs.contracts.images import MAX_CHUNK_BYTES, image_archive
from tests.support.schedulers import Login, refused, spec
from tests.support.tarballs import rootfs_tarball

pytestmark = pytest.mark.asyncio(loop_scope="session")




async def test_an_image_is_uploaded_registered_and_listed_by_everyone(login: Login, tmp_path: Path) -> None:
    admin = await login("root", admin=True)
    archive = rootfs_tarball(tmp_path / "tiny.tar", payload_bytes=2 * MAX_CHUNK_BYTES + 1000)
    seen: list[int] = []
    image = await admin.register_image("tiny/base:1", archive, boards=["cpu", "sim-a100"], description="tiny",
                                       progress=lambda sent, total: seen.append(sent))
    digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    assert (image.ref, image.digest, image.format, image.training, image.boards) == (
        "tiny/base:1", digest, "rootfs", True, ["cpu", "sim-a100"])
    assert len(seen) == 3 and seen[-1] == archive.stat().st_size  # three chunks
    stored = tmp_path / "storage" / image_archive(digest)
    assert stored.read_bytes() == archive.read_bytes()
    assert not list((tmp_path / "storage" / "images" / "uploads").glob("*"))  # the upload became the archive

    alice = await login("alice")
    assert [found.ref for found in await alice.images()] == ["tiny/base:1"]
    assert (await alice.images("tiny/base:1"))[0].digest == digest
    error = (await refused(alice.images("tiny/base:2"))).error
    assert (error.code, error.message) == ("not-found", "tiny/base:2 is not a registered image")


async def test_only_administrators_manage_images(login: Login, tmp_path: Path) -> None:
    alice = await login("alice")
    archive = rootfs_tarball(tmp_path / "tiny.tar")
    error = (await refused(alice.register_image("tiny/base:1", archive, boards=["cpu"]))).error
    assert (error.code, error.message) == ("forbidden", "only administrators upload images")
    admin = await login("root", admin=True)
    await admin.register_image("tiny/base:1", archive, boards=["cpu"])
    for call in (alice.mark_image("tiny/base:1", training=False), alice.delete_image("tiny/base:1")):
        assert (await refused(call)).error.code == "forbidden"
    assert (await alice.images())[0].training


async def test_a_file_that_is_no_image_archive_is_refused_and_nothing_is_kept(login: Login, tmp_path: Path) -> None:
    admin = await login("root", admin=True)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a tar\n")
    error = (await refused(admin.register_image("tiny/base:1", notes, boards=["cpu"]))).error
    assert error.code == "invalid-request"
    assert error.message.startswith("the uploaded file is not a tar archive")
    assert await admin.images() == []
    assert not list((tmp_path / "storage" / "images").rglob("*.*"))


async def test_a_job_runs_only_in_a_marked_image_of_its_flavors_boards(login: Login, tmp_path: Path) -> None:
    admin = await login("root", admin=True)
    alice = await login("alice")
    await admin.register_image("tiny/base:1", rootfs_tarball(tmp_path / "cpu.tar"), boards=["cpu"], training=False)
    await admin.register_image("tiny/gpu:1", rootfs_tarball(tmp_path / "gpu.tar"), boards=["sim-a100"])

    unknown = (await refused(alice.submit(spec(image="tiny/other:1")))).error
    assert (unknown.code, [e.field for e in unknown.errors]) == ("invalid-spec", ["image"])
    assert "tiny/other:1 is not a registered image" in unknown.message
    unmarked = (await refused(alice.submit(spec(image="tiny/base:1")))).error
    assert "tiny/base:1 is not marked for training jobs" in unmarked.message
    wrong_board = (await refused(alice.submit(spec(image="tiny/gpu:1", flavors=["cpu-1"])))).error
    assert [e.field for e in wrong_board.errors] == ["flavors[0]"]
    assert "flavor 'cpu-1' has board cpu, and image tiny/gpu:1 is built for sim-a100" in wrong_board.message
    assert await alice.list_jobs() == []

    await admin.mark_image("tiny/base:1", training=True)
    accepted = await alice.submit(spec(image="tiny/base:1"))
    gpu = await alice.submit(spec(image="tiny/gpu:1", flavors=["sim-gpu-1"]))
    assert accepted.created and gpu.created


async def test_a_job_keeps_its_image_when_the_catalogue_changes(login: Login, tmp_path: Path) -> None:
    admin = await login("root", admin=True)
    first = await admin.register_image("tiny/base:1", rootfs_tarball(tmp_path / "a.tar", 10), boards=["cpu"])
    alice = await login("alice")
    queued = await alice.submit(spec(image="tiny/base:1"))
    replaced = await admin.register_image("tiny/base:1", rootfs_tarball(tmp_path / "b.tar", 20), boards=["cpu"],
                                          replace=True)
    assert replaced.digest != first.digest
    conflict = (await refused(admin.register_image("tiny/base:1", tmp_path / "a.tar", boards=["cpu"]))).error
    assert conflict.code == "conflict"

    history = await alice.history(queued.job_id)
    submitted = history[0].event
    assert isinstance(submitted, JobSubmitted) and submitted.image is not None
    assert submitted.image.digest == first.digest  # what the name meant when it was accepted
    message = await admin.delete_image("tiny/base:1")
    assert message == "deleted image tiny/base:1"
    storage = tmp_path / "storage"
    assert (storage / image_archive(first.digest)).exists()  # the queued job still runs in it
    assert not (storage / image_archive(replaced.digest)).exists()
    gone = (await refused(alice.submit(spec(image="tiny/base:1")))).error
    assert "tiny/base:1 is not a registered image" in gone.message
