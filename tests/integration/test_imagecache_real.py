"""A node's image cache (SPEC J10) with a real Debian image, as an OCI archive, a docker archive and a
root-filesystem tarball (tests/support/testimage.py builds it once per machine, which takes minutes)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.caches.imagecache import ImageCache, ImageCacheError
from agent.processes.jobenv import DEFAULT_PATH
from libs.contracts.images import ImageFormat
from libs.imagefiles import detect_format, file_digest
from tests.support import testimage

pytestmark = pytest.mark.timeout(1800)  # the first build of the test image (debootstrap) takes minutes


@pytest.fixture(scope="module")
def image() -> testimage.TestImage:
    if problem := testimage.test_image_problem():
        pytest.skip(problem)
    return testimage.test_image()


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[ImageCache]:
    made = ImageCache(tmp_path / "image-cache")
    made.clean_partial()
    yield made
    shutil.rmtree(made.root, ignore_errors=True)  # hundreds of MiB each: not left for pytest's last runs


def archive_of(image: testimage.TestImage, image_format: ImageFormat) -> Path:
    return {"oci-archive": image.oci_archive, "docker-archive": image.docker_archive,
            "rootfs": image.rootfs_tar}[image_format]


@pytest.mark.parametrize("image_format", ["oci-archive", "docker-archive", "rootfs"])
async def test_each_kind_of_archive_unpacks_into_the_image_root_filesystem(
        image: testimage.TestImage, cache: ImageCache, image_format: ImageFormat) -> None:
    archive = archive_of(image, image_format)
    assert detect_format(archive) == image_format
    digest = file_digest(archive)
    root = await cache.acquire(archive, digest, image_format, "job-000000000001/1/0/0")
    assert root.cold
    assert (root.rootfs / testimage.MARK_FILE).read_text() == testimage.MARK_TEXT
    assert f"VARIANT_ID={testimage.VARIANT}" in (root.rootfs / "etc/os-release").read_text().splitlines()
    assert (root.rootfs / "usr/bin/python3").exists() and (root.rootfs / "srv").is_dir()
    if image_format == "rootfs":
        assert root.env == {"PATH": DEFAULT_PATH} and root.workdir is None
    else:
        assert root.env == {"PATH": testimage.PATH_VALUE, "TRAINYARD_IMAGE_VAR": "from-image"}
        assert root.workdir == "/srv"
    if os.geteuid() == 0:  # the image runs: its own python reads its own files
        shown = await asyncio.create_subprocess_exec(
            "chroot", str(root.rootfs), "/usr/bin/python3", "-c",
            "print(open('/etc/trainyard-test-image').read(), end='')", stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(shown.communicate(), 60)
        assert shown.returncode == 0 and out.decode() == testimage.MARK_TEXT

    again = await cache.acquire(archive, digest, image_format, "job-000000000002/1/0/0")
    assert not again.cold and again.rootfs == root.rootfs and again.env == root.env
    [held] = cache.entries()
    assert held.key == root.key and held.pinned and held.bytes > 50 * 2**20
    assert list(cache.partial_dir.iterdir()) == []  # nothing of the unpacking (layouts, bundles) is left
    assert sorted(p.name for p in (cache.entries_dir / root.key).iterdir()) == ["entry.json", "rootfs", "used"]


async def test_an_archive_with_another_digest_is_refused_and_nothing_cached(
        image: testimage.TestImage, cache: ImageCache) -> None:
    registered = file_digest(image.rootfs_tar)  # the digest of another archive
    with pytest.raises(ImageCacheError) as refused:
        await cache.acquire(image.oci_archive, registered, "oci-archive", "job-000000000001/1/0/0")
    assert str(image.oci_archive) in str(refused.value) and registered in str(refused.value)
    assert cache.entries() == [] and list(cache.entries_dir.iterdir()) == []
    assert list(cache.partial_dir.iterdir()) == []
