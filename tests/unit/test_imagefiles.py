"""Image archives (SPEC J10): an OCI archive, a docker archive and a root-filesystem tarball are told apart by
their members' names (compressed or not), anything else is refused with what to do, and digests are sha256."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from libs.imagefiles import ImageArchiveError, detect_format, file_digest


def make_tar(path: Path, names: Sequence[str], *, mode: str = "w", size: int = 16) -> Path:
    """A tar of `names`: those ending in "/" are folders, the others files of `size` bytes."""
    with tarfile.open(path, mode) as archive:  # type: ignore[call-overload]
        for name in names:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = size
                archive.addfile(info, io.BytesIO(b"x" * size))
    return path


OCI = ["blobs/", "blobs/sha256/", "blobs/sha256/" + "a" * 64, "index.json", "oci-layout"]  # as skopeo writes it
DOCKER = ["3f1c/", "3f1c/layer.tar", "3f1c/json", "3f1c/VERSION", "manifest.json", "repositories"]
ROOTFS = ["./", "./etc/", "./etc/os-release", "./usr/", "./usr/bin/", "./usr/bin/python3"]


@pytest.mark.parametrize(("names", "expected"), [
    (OCI, "oci-archive"),
    (["./" + name for name in OCI], "oci-archive"),  # tar -C layout -cf image.tar .
    (["oci-layout", "index.json", "blobs/"], "oci-archive"),
    (DOCKER, "docker-archive"),
    (["./" + name for name in DOCKER], "docker-archive"),
    (ROOTFS, "rootfs"),
    (["usr/", "usr/lib/", "usr/lib/libc.so.6"], "rootfs"),  # no ./, and no folder of etc/
    (["bin", "etc/passwd"], "rootfs"),  # a member inside etc/ without the folder's own
])
def test_each_kind_of_archive_is_recognised_by_its_names(tmp_path: Path, names: list[str], expected: str) -> None:
    assert detect_format(make_tar(tmp_path / "image.tar", names)) == expected


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_compressed_archives_are_recognised_too(tmp_path: Path, mode: str) -> None:
    assert detect_format(make_tar(tmp_path / "a.tar", OCI, mode=mode)) == "oci-archive"
    assert detect_format(make_tar(tmp_path / "d.tar", DOCKER, mode=mode)) == "docker-archive"
    assert detect_format(make_tar(tmp_path / "r.tar", ROOTFS, mode=mode)) == "rootfs"


@pytest.mark.parametrize("names", [
    ["README.md", "src/", "src/main.py"],  # a source tarball
    ["index.json", "blobs/", "blobs/sha256/x"],  # an OCI layout without its oci-layout file
    ["image/", "image/oci-layout", "image/index.json"],  # a layout inside a folder, not at the top
    ["backup/manifest.json", "backup/etc/", "backup/etc/passwd"],  # nothing of either at the top
    [],  # an empty tar
])
def test_other_tarballs_are_refused_saying_how_to_make_an_image(tmp_path: Path, names: list[str]) -> None:
    archive = make_tar(tmp_path / "other.tar", names)
    with pytest.raises(ImageArchiveError) as refused:
        detect_format(archive)
    message = str(refused.value)
    assert str(archive) in message
    assert "neither an OCI archive, a docker archive nor a root-filesystem tarball" in message
    assert "podman save --format oci-archive" in message and "tar -C rootfs -cf image.tar ." in message


def test_a_file_that_is_no_tar_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "image.tar"
    text.write_text("this is not an archive\n" * 100)
    with pytest.raises(ImageArchiveError, match="is not a tar archive"):
        detect_format(text)
    with pytest.raises(ImageArchiveError, match="does not exist"):
        detect_format(tmp_path / "missing.tar")


def test_reading_stops_once_the_names_tell_so_a_damaged_tail_does_not_matter(tmp_path: Path) -> None:
    """Archives are gigabytes: what comes after the deciding member is never read."""
    for names, expected in ((["etc/", *[f"big{i}" for i in range(8)]], "rootfs"),
                            (["oci-layout", "index.json", *[f"blobs/{i}" for i in range(8)]], "oci-archive")):
        archive = make_tar(tmp_path / "image.tar", names, size=64 * 1024)
        whole = archive.read_bytes()
        archive.write_bytes(whole[: len(whole) // 2] + b"\x07" * 4096)  # the second half is garbage
        assert detect_format(archive) == expected
        # The same damage before an answer is known is reported as damage.
        late = make_tar(tmp_path / "late.tar", [*[f"big{i}" for i in range(8)], "etc/"], size=64 * 1024)
        late.write_bytes(late.read_bytes()[: len(whole) // 2] + b"\x07" * 4096)
        with pytest.raises(ImageArchiveError, match="truncated or damaged"):
            detect_format(late)


def test_a_digest_is_the_sha256_of_the_whole_file(tmp_path: Path) -> None:
    content = bytes(range(256)) * (5 * 4096 + 3)  # more than a few chunks of 1 MiB, not a multiple of one
    path = tmp_path / "image.tar"
    path.write_bytes(content)
    assert file_digest(path) == "sha256:" + hashlib.sha256(content).hexdigest()
    path.write_bytes(content[:-1] + b"\0")
    assert file_digest(path) != "sha256:" + hashlib.sha256(content).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_digest(tmp_path / "empty") == "sha256:" + hashlib.sha256(b"").hexdigest()
