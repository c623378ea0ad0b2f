"""A node's cache reports (SPEC D1, D2, J10): the dataset cache, cut short and saying so when it holds more
entries than a report carries, and the images the node keeps unpacked, reported whenever either changes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.caches.datacache import DatasetCache
from agent.caches.imagecache import ImageCache
from agent.caches.imageprep import ImagePreparation
from agent.caches.preparation import DataPreparation
from libs.contracts.codec import decode, encode
from libs.contracts.datacache import MAX_CACHE_ENTRIES_REPORTED, CacheEntry, CachePolicy, CacheReport
from libs.contracts.images import ImageUse, image_archive
from libs.imagefiles import file_digest

HOLDER = "job-000000000001/1/0/0"
OTHER = "job-000000000002/1/0/0"
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


@pytest.fixture
def data(tmp_path: Path) -> DataPreparation:
    cache = DatasetCache(tmp_path / "cache", tmp_path / "storage", workers=1)
    cache.open()
    return DataPreparation(cache, "node-a")


@pytest.fixture
def images(tmp_path: Path) -> ImagePreparation:
    cache = ImageCache(tmp_path / "images")
    cache.clean_partial()
    return ImagePreparation(cache, "node-a", tmp_path / "storage", CachePolicy)


def registered(storage: Path, tmp_path: Path, name: str) -> ImageUse:
    """A tiny root filesystem's archive in shared storage where the catalogue keeps it, and a job's use of it."""
    made = tmp_path / f"{name}.tar"
    with tarfile.open(made, "w") as archive:
        marker = tarfile.TarInfo("etc/marker")
        marker.size = 8192
        archive.addfile(marker, io.BytesIO(name.encode().ljust(8192)))
    digest = file_digest(made)
    (storage / image_archive(digest)).parent.mkdir(parents=True, exist_ok=True)
    made.rename(storage / image_archive(digest))
    return ImageUse(ref=f"team/{name}:1", digest=digest, format="rootfs")


class Reports:
    """The reports a node's reporting task publishes, as the monitor decodes them."""

    def __init__(self) -> None:
        self.sent: list[CacheReport] = []

    async def publish(self, report: CacheReport, _: str) -> None:
        self.sent.append(decode(encode(report), CacheReport))

    async def next(self, where: Callable[[CacheReport], bool]) -> CacheReport:
        async with asyncio.timeout(10):
            while not (found := [r for r in self.sent if where(r)]):
                await asyncio.sleep(0.02)
        return found[-1]


# --- the image cache as reported ------------------------------------------------------------------------------


async def test_the_image_cache_lists_each_image_with_its_reference_size_last_use_and_users(
        images: ImagePreparation, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    first, second = registered(storage, tmp_path, "first"), registered(storage, tmp_path, "second")
    one = await images.prepare(first, HOLDER, tmp_path / "rank-1")
    two = await images.prepare(second, OTHER, tmp_path / "rank-2")
    long_ago = (NOW - timedelta(days=3)).timestamp()
    os.utime(images.cache.entries_dir / one.key / "used", (long_ago, long_ago))

    listed = images.cache.images()
    assert [(i.key, i.ref, i.digest, i.format, i.pins) for i in listed] == [
        (two.key, "team/second:1", second.digest, "rootfs", [OTHER]),  # the most recently used first
        (one.key, "team/first:1", first.digest, "rootfs", [HOLDER])]
    entry = json.loads((images.cache.entries_dir / one.key / "entry.json").read_text())
    assert listed[1].bytes == entry["bytes"] >= 8192
    assert listed[1].last_used == datetime.fromtimestamp(long_ago, UTC)
    assert listed[1].unpacked_at == datetime.fromisoformat(entry["unpacked_at"])
    images.release(HOLDER)
    assert [i.pins for i in images.cache.images()] == [[OTHER], []]


async def test_an_image_an_older_agent_unpacked_is_listed_without_its_reference_and_a_broken_one_not_at_all(
        images: ImagePreparation, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    older = await images.prepare(registered(storage, tmp_path, "older"), HOLDER, tmp_path / "rank-1")
    broken = await images.prepare(registered(storage, tmp_path, "broken"), HOLDER, tmp_path / "rank-2")
    for key, change in ((older.key, {"ref": None}), (broken.key, {"digest": "../etc"})):
        path = images.cache.entries_dir / key / "entry.json"
        entry = {**json.loads(path.read_text()), **change}
        path.write_text(json.dumps({name: value for name, value in entry.items() if value is not None}))
    assert [(i.key, i.ref) for i in images.cache.images()] == [(older.key, "")]


# --- reporting ------------------------------------------------------------------------------------------------


async def test_an_image_unpacked_used_or_released_is_reported_with_the_dataset_cache(
        data: DataPreparation, images: ImagePreparation, tmp_path: Path) -> None:
    reports = Reports()
    reporting = asyncio.create_task(data.reporting(reports.publish, images))
    try:
        data.cache.changed.set()  # the agent's first report
        first = await reports.next(lambda r: True)
        assert first.images == [] and first.complete and first.total_entries == 0

        use = registered(tmp_path / "storage", tmp_path, "torch")
        root = await images.prepare(use, HOLDER, tmp_path / "rank-1")  # only the image cache changed
        unpacked = await reports.next(lambda r: bool(r.images))
        assert [(i.key, i.ref, i.digest, i.pins) for i in unpacked.images] == [
            (root.key, use.ref, use.digest, [HOLDER])]

        images.release(HOLDER)
        released = await reports.next(lambda r: bool(r.images) and not r.images[0].pins)
        assert [i.key for i in released.images] == [root.key]
    finally:
        reporting.cancel()


async def test_a_cache_of_more_entries_than_a_report_carries_sends_the_most_recently_used_and_says_so(
        data: DataPreparation, monkeypatch: pytest.MonkeyPatch) -> None:
    held = [CacheEntry(key=f"{i:024x}", source=f"datasets/d{i}", bytes=1, files=1, staged_at=NOW,
                       last_used=NOW - timedelta(seconds=i)) for i in range(MAX_CACHE_ENTRIES_REPORTED + 3)]
    monkeypatch.setattr(data.cache, "entries", lambda: held)  # the most recently used first, as the cache lists them
    reports = Reports()
    reporting = asyncio.create_task(data.reporting(reports.publish))
    try:
        data.cache.changed.set()
        report = await reports.next(lambda r: True)
    finally:
        reporting.cancel()
    assert report.entries == held[:MAX_CACHE_ENTRIES_REPORTED]
    assert report.total_entries == MAX_CACHE_ENTRIES_REPORTED + 3 and not report.complete
