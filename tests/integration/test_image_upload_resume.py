"""J10 on real NATS and PostgreSQL: an image upload cut off half-way (the client killed, its connection cut) goes
on, when the same archive is registered again, from what the scheduler holds; the bytes it holds are not sent
again. A partial upload is its uploader's: another administrator neither resumes nor registers nor removes it.
A partial upload nothing was added to for a day is removed when an upload begins, as before."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from client.api import NoAnswer, TrainyardClient
from libs.contracts.images import MAX_CHUNK_BYTES, image_archive
from libs.contracts.operations.base import Operation
from libs.contracts.operations.images import REGISTER_IMAGE, UPLOAD_IMAGE, RegisterImage, UploadImageChunk
from libs.imagefiles import file_digest
from tests.support.schedulers import Login, refused
from tests.support.tarballs import rootfs_tarball

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHUNKS = 5  # the archive's chunks: two are sent before the cut




class Killed(Exception):
    """The client process going away in the middle of an upload."""


def chunks_sent(client: TrainyardClient, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, length) of every upload chunk `client` sends from now on."""
    sent: list[tuple[int, int]] = []
    ask = client.ask

    async def recording(operation: Operation[Any, Any], request: Any) -> Any:
        if isinstance(request, UploadImageChunk):
            sent.append((request.offset, len(request.data)))
        return await ask(operation, request)

    monkeypatch.setattr(client, "ask", recording)
    return sent


def killed_after(chunks: int) -> Any:
    """A progress callback that kills the upload once `chunks` chunks were taken."""
    seen: list[int] = []

    def progress(sent: int, total: int) -> None:
        seen.append(sent)
        if len(seen) == chunks:
            raise Killed

    return progress


def parts(storage: Path) -> list[Path]:
    return sorted((storage / "images" / "uploads").glob("*.part"))


async def cut_off(client: TrainyardClient, archive: Path) -> Path:
    """Register `archive`, killed after two chunks; the partial upload the scheduler keeps."""
    with pytest.raises(Killed):
        await client.register_image("tiny/base:1", archive, boards=["cpu"], progress=killed_after(2))
    return archive


async def test_an_upload_cut_off_half_way_sends_only_the_rest_when_run_again(
        login: Login, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = await login("root", admin=True)
    archive = rootfs_tarball(tmp_path / "tiny.tar", payload_bytes=(CHUNKS - 1) * MAX_CHUNK_BYTES + 1000)
    total = archive.stat().st_size
    storage = tmp_path / "storage"
    await cut_off(admin, archive)
    [part] = parts(storage)
    assert part.read_bytes() == archive.read_bytes()[:2 * MAX_CHUNK_BYTES]

    again = await login("root", admin=True)  # a new process of the same person
    sent = chunks_sent(again, monkeypatch)
    seen: list[int] = []
    image = await again.register_image("tiny/base:1", archive, boards=["cpu"],
                                       progress=lambda done, _: seen.append(done))
    assert (image.digest, image.size_bytes, image.format) == (file_digest(archive), total, "rootfs")
    # One question (a chunk without data), then the three chunks the scheduler did not hold.
    assert sent == [(0, 0)] + [(index * MAX_CHUNK_BYTES, len(chunk)) for index, chunk in
                               enumerate(_chunks(archive.read_bytes())) if index >= 2]
    assert seen == [2 * MAX_CHUNK_BYTES, 3 * MAX_CHUNK_BYTES, 4 * MAX_CHUNK_BYTES, total]
    assert (storage / image_archive(image.digest)).read_bytes() == archive.read_bytes()
    assert parts(storage) == []


async def test_an_upload_whose_connection_was_cut_goes_on_from_what_the_scheduler_took(
        login: Login, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = await login("root", admin=True)
    archive = rootfs_tarball(tmp_path / "tiny.tar", payload_bytes=(CHUNKS - 1) * MAX_CHUNK_BYTES + 1000)
    closing: list[asyncio.Task[None]] = []

    def cut_after_two(sent: int, total: int) -> None:
        if sent == 2 * MAX_CHUNK_BYTES:
            closing.append(asyncio.get_running_loop().create_task(admin.nc.close()))

    with pytest.raises(NoAnswer):
        await admin.register_image("tiny/base:1", archive, boards=["cpu"], progress=cut_after_two)
    await asyncio.gather(*closing)
    assert len(parts(tmp_path / "storage")) == 1  # what the scheduler took is kept

    again = await login("root", admin=True)
    sent = chunks_sent(again, monkeypatch)
    image = await again.register_image("tiny/base:1", archive, boards=["cpu"])
    assert image.digest == file_digest(archive)
    probe, *rest = sent
    held = rest[0][0]  # a chunk the closing connection sent may still have been taken
    assert probe == (0, 0) and 2 * MAX_CHUNK_BYTES <= held < archive.stat().st_size
    assert rest == [(index * MAX_CHUNK_BYTES, len(chunk)) for index, chunk in enumerate(_chunks(archive.read_bytes()))
                    if index * MAX_CHUNK_BYTES >= held]


async def test_another_administrator_neither_resumes_nor_registers_nor_removes_a_partial_upload(
        login: Login, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = await login("root", admin=True)
    archive = rootfs_tarball(tmp_path / "tiny.tar", payload_bytes=(CHUNKS - 1) * MAX_CHUNK_BYTES + 1000)
    storage = tmp_path / "storage"
    await cut_off(root, archive)
    [part] = parts(storage)
    held = part.read_bytes()
    upload_id = file_digest(archive).removeprefix("sha256:")[:32]  # the id the client names the archive's upload

    bob = await login("bob", admin=True)
    # Naming root's upload gets bob nothing of it: it holds nothing for him, and there is nothing to register.
    chunk = UploadImageChunk(upload_id=upload_id, offset=2 * MAX_CHUNK_BYTES, data=b"x")
    error = (await refused(bob.ask(UPLOAD_IMAGE, chunk))).error
    assert (error.code, error.hint) == ("conflict", "send the archive on from byte 0")
    register = RegisterImage(name="tiny", tag="stolen", upload_id=upload_id, digest=file_digest(archive),
                             boards=["cpu"])
    assert (await refused(bob.ask(REGISTER_IMAGE, register))).error.code == "not-found"
    assert parts(storage) == [part] and part.read_bytes() == held

    # Bob registering the same archive sends all of it himself, and root's partial upload stays root's.
    sent = chunks_sent(bob, monkeypatch)
    image = await bob.register_image("tiny/base:2", archive, boards=["cpu"])
    assert image.digest == file_digest(archive)
    assert [offset for offset, _ in sent] == [0] + [index * MAX_CHUNK_BYTES for index in range(CHUNKS)]
    assert parts(storage) == [part] and part.read_bytes() == held

    seen: list[int] = []
    await root.register_image("tiny/base:1", archive, boards=["cpu"], progress=lambda done, _: seen.append(done))
    assert seen[0] == 2 * MAX_CHUNK_BYTES and parts(storage) == []


async def test_a_partial_upload_left_for_a_day_is_removed_when_an_upload_begins(
        login: Login, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = await login("root", admin=True)
    bob = await login("bob", admin=True)
    storage = tmp_path / "storage"
    archive = await cut_off(root, rootfs_tarball(tmp_path / "a.tar", payload_bytes=3 * MAX_CHUNK_BYTES))
    other = rootfs_tarball(tmp_path / "b.tar", payload_bytes=3 * MAX_CHUNK_BYTES + 7)
    with pytest.raises(Killed):
        await bob.register_image("tiny/other:1", other, boards=["cpu"], progress=killed_after(1))
    [first, second] = sorted(parts(storage), key=lambda part: part.stat().st_size, reverse=True)
    day_ago = time.time() - 25 * 3600
    for part in (first, second):
        os.utime(part, (day_ago, day_ago))

    # Root's own stale upload is gone when he begins again: everything is sent anew; bob's went with it.
    sent = chunks_sent(root, monkeypatch)
    image = await root.register_image("tiny/base:1", archive, boards=["cpu"])
    assert image.digest == file_digest(archive)
    assert [offset for offset, _ in sent] == [0, 0, MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES, 3 * MAX_CHUNK_BYTES]
    assert parts(storage) == []


async def test_a_registration_refused_for_its_tag_keeps_the_upload_for_the_next_attempt(
        login: Login, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = await login("root", admin=True)
    await root.register_image("tiny/base:1", rootfs_tarball(tmp_path / "a.tar", payload_bytes=10), boards=["cpu"])
    archive = rootfs_tarball(tmp_path / "b.tar", payload_bytes=2 * MAX_CHUNK_BYTES)
    conflict = (await refused(root.register_image("tiny/base:1", archive, boards=["cpu"]))).error
    assert conflict.code == "conflict"
    sent = chunks_sent(root, monkeypatch)
    image = await root.register_image("tiny/base:1", archive, boards=["cpu"], replace=True)
    assert image.digest == file_digest(archive) and sent == [(0, 0)]  # only the question: all of it was held
    assert parts(tmp_path / "storage") == []


async def test_a_chunk_partly_held_is_taken_for_its_rest_and_one_past_the_end_is_refused(
        login: Login, tmp_path: Path) -> None:
    root = await login("root", admin=True)
    data = os.urandom(MAX_CHUNK_BYTES)
    upload_id = "ab" * 16
    first = await root.ask(UPLOAD_IMAGE, UploadImageChunk(upload_id=upload_id, offset=0, data=data[:1000]))
    overlapping = await root.ask(UPLOAD_IMAGE, UploadImageChunk(upload_id=upload_id, offset=500, data=data[500:3000]))
    again = await root.ask(UPLOAD_IMAGE, UploadImageChunk(upload_id=upload_id, offset=0, data=data[:2000]))
    asked = await root.ask(UPLOAD_IMAGE, UploadImageChunk(upload_id=upload_id, offset=0, data=b""))
    assert [reply.received_bytes for reply in (first, overlapping, again, asked)] == [1000, 3000, 3000, 3000]
    [part] = parts(tmp_path / "storage")
    assert part.read_bytes() == data[:3000]
    past = UploadImageChunk(upload_id=upload_id, offset=3001, data=b"x")
    error = (await refused(root.ask(UPLOAD_IMAGE, past))).error
    assert (error.code, error.hint) == ("conflict", "send the archive on from byte 3000")
    asked_past = UploadImageChunk(upload_id=upload_id, offset=3001, data=b"")
    assert (await refused(root.ask(UPLOAD_IMAGE, asked_past))).error.code == "conflict"


def _chunks(data: bytes) -> list[bytes]:
    return [data[start:start + MAX_CHUNK_BYTES] for start in range(0, len(data), MAX_CHUNK_BYTES)]
