"""A node's image cache (SPEC J10), with tiny root-filesystem tarballs: an image is unpacked once after its
digest is checked, reused, pinned while used, evicted by the dataset cache's rules, and a crash's leftovers
are removed at start."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import os
import shutil
import tarfile
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.caches import imagecache
from agent.caches.cachepolicy import Held
from agent.caches.imagecache import ImageCache, ImageCacheError, ImageRoot
from agent.processes.jobenv import DEFAULT_PATH
from libs.contracts.datacache import CachePolicy
from libs.imagefiles import file_digest

HOLDER = "job-000000000001/1/0/0"
OTHER = "job-000000000002/1/0/0"
POLICY = CachePolicy(retention_seconds=7 * 86400, high_percent=50, low_percent=40, disk_high_percent=90,
                     disk_low_percent=85)


def rootfs_tarball(path: Path, marker: str, *, mode: str = "w", size: int = 4096) -> tuple[Path, str]:
    """A tiny root filesystem (etc/marker holds `marker`) as a tarball, and its digest."""
    with tarfile.open(path, mode) as archive:  # type: ignore[call-overload]
        for folder in ("etc", "usr", "usr/bin", "srv"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            archive.addfile(info)
        for name, content in (("etc/marker", marker.encode()), ("usr/bin/tool", b"#" * size)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), 0o755
            archive.addfile(info, io.BytesIO(content))
        link = tarfile.TarInfo("bin")
        link.type, link.linkname = tarfile.SYMTYPE, "usr/bin"
        archive.addfile(link)
    return path, file_digest(path)


@pytest.fixture
def cache(tmp_path: Path) -> ImageCache:
    made = ImageCache(tmp_path / "cache")
    made.clean_partial()
    return made


def leftovers(cache: ImageCache) -> list[str]:
    return sorted(p.name for p in cache.partial_dir.iterdir())


def pinned_by(cache: ImageCache, key: str) -> list[str]:
    folder = cache.pins_dir / key
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# --- acquiring --------------------------------------------------------------------------------------------


async def test_an_image_is_unpacked_once_then_served_from_the_cache(cache: ImageCache, tmp_path: Path) -> None:
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "first image")
    first = await cache.acquire(archive, digest, "rootfs", HOLDER)
    assert first.cold and first.rootfs.is_absolute()
    assert first.key == digest.removeprefix("sha256:")[:24]
    assert (first.rootfs / "etc/marker").read_text() == "first image"
    assert (first.rootfs / "bin").is_symlink() and (first.rootfs / "bin/tool").is_file()
    assert first.env == {"PATH": DEFAULT_PATH} and first.workdir is None
    entry = json.loads((cache.entries_dir / first.key / "entry.json").read_text())
    assert entry["digest"] == digest and entry["format"] == "rootfs" and entry["bytes"] >= 4096

    archive.unlink()  # a cached image needs its archive no more
    again = await cache.acquire(archive, digest, "rootfs", OTHER)
    assert not again.cold and again.rootfs == first.rootfs and again.env == first.env
    assert leftovers(cache) == []
    [held] = cache.entries()
    assert held.key == first.key and held.pinned and held.bytes == entry["bytes"]


async def test_a_compressed_rootfs_tarball_unpacks_too(cache: ImageCache, tmp_path: Path) -> None:
    archive, digest = rootfs_tarball(tmp_path / "image.tar.gz", "gzipped", mode="w:gz")
    root = await cache.acquire(archive, digest, "rootfs", HOLDER)
    assert (root.rootfs / "etc/marker").read_text() == "gzipped"


async def test_every_use_marks_the_entry_used(cache: ImageCache, tmp_path: Path) -> None:
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "x")
    root = await cache.acquire(archive, digest, "rootfs", HOLDER)
    long_ago = datetime(2020, 1, 1, tzinfo=UTC).timestamp()
    os.utime(cache.entries_dir / root.key / "used", (long_ago, long_ago))
    assert cache.entries()[0].last_used.year == 2020
    await cache.acquire(archive, digest, "rootfs", OTHER)
    assert cache.entries()[0].last_used > datetime.now(UTC) - timedelta(minutes=1)


async def test_an_archive_that_is_not_the_registered_one_is_refused_and_nothing_kept(
        cache: ImageCache, tmp_path: Path) -> None:
    archive, _ = rootfs_tarball(tmp_path / "image.tar", "tampered")
    _, registered = rootfs_tarball(tmp_path / "registered.tar", "what was registered")
    with pytest.raises(ImageCacheError) as refused:
        await cache.acquire(archive, registered, "rootfs", HOLDER)
    assert str(archive) in str(refused.value) and registered in str(refused.value)
    assert "register the image again" in str(refused.value) and not refused.value.node_fault
    assert cache.entries() == [] and list(cache.entries_dir.iterdir()) == [] and leftovers(cache) == []
    assert pinned_by(cache, registered.removeprefix("sha256:")[:24]) == []  # the failed acquire holds nothing


async def test_a_missing_archive_and_a_malformed_digest_are_refused(cache: ImageCache, tmp_path: Path) -> None:
    with pytest.raises(ImageCacheError, match=r"missing\.tar does not exist"):
        await cache.acquire(tmp_path / "missing.tar", "sha256:" + "a" * 64, "rootfs", HOLDER)
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "x")
    with pytest.raises(ImageCacheError, match="not an image digest"):
        await cache.acquire(archive, digest.removeprefix("sha256:"), "rootfs", HOLDER)
    assert cache.entries() == []


async def test_a_failing_tool_is_reported_with_its_own_words_and_nothing_kept(
        cache: ImageCache, tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    archive.write_text("no tar at all\n")
    with pytest.raises(ImageCacheError) as failed:
        await cache.acquire(archive, file_digest(archive), "rootfs", HOLDER)
    assert str(archive) in str(failed.value) and "tar failed: " in str(failed.value)
    assert "tar: " in str(failed.value)  # tar's own last line
    assert cache.entries() == [] and leftovers(cache) == []


async def test_a_node_without_the_tools_is_at_fault_not_the_image(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "x")
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    with pytest.raises(ImageCacheError, match="tar is not installed on this node") as failed:
        await cache.acquire(archive, digest, "rootfs", HOLDER)
    assert failed.value.node_fault
    assert cache.entries() == [] and leftovers(cache) == []


# --- one unpack per image ---------------------------------------------------------------------------------


@pytest.fixture
def tool_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The unpacking tools run, each slowed down so that acquires overlap."""
    runs: list[str] = []
    real = imagecache._tool

    async def counted(command: Sequence[str | Path], archive: Path, **options: Any) -> None:
        runs.append(str(command[0]))
        await asyncio.sleep(0.3)
        await real(command, archive, **options)

    monkeypatch.setattr(imagecache, "_tool", counted)
    return runs


async def test_acquires_of_one_image_at_once_unpack_it_once(
        cache: ImageCache, tmp_path: Path, tool_runs: list[str]) -> None:
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "shared")
    holders = [f"job-00000000000{i}/1/0/0" for i in range(1, 5)]
    roots = await asyncio.gather(*(cache.acquire(archive, digest, "rootfs", h) for h in holders))
    assert tool_runs == ["tar"]
    assert [r.cold for r in roots].count(True) == 1 and len({r.rootfs for r in roots}) == 1
    assert pinned_by(cache, roots[0].key) == sorted(h.replace("/", "_") for h in holders)


async def test_agents_sharing_a_cache_folder_unpack_an_image_once(
        tmp_path: Path, tool_runs: list[str]) -> None:
    first, second = ImageCache(tmp_path / "cache"), ImageCache(tmp_path / "cache")
    first.clean_partial()
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "shared")
    roots = await asyncio.gather(first.acquire(archive, digest, "rootfs", HOLDER),
                                 second.acquire(archive, digest, "rootfs", OTHER))
    assert tool_runs == ["tar"] and sorted(r.cold for r in roots) == [False, True]
    assert (roots[1].rootfs / "etc/marker").read_text() == "shared"


async def test_an_agent_that_looked_before_another_finished_unpacking_does_not_unpack_again(
        tmp_path: Path, tool_runs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = ImageCache(tmp_path / "cache"), ImageCache(tmp_path / "cache")
    first.clean_partial()
    archive, digest = rootfs_tarball(tmp_path / "image.tar", "shared")
    monkeypatch.setattr(second, "_root_locked", lambda key: None)  # it found nothing: the first was not done
    roots = await asyncio.gather(first.acquire(archive, digest, "rootfs", HOLDER),
                                 second.acquire(archive, digest, "rootfs", OTHER))
    assert tool_runs == ["tar"] and sorted(r.cold for r in roots) == [False, True]
    assert leftovers(first) == []


async def test_a_failed_unpack_fails_every_acquire_waiting_for_it(
        cache: ImageCache, tmp_path: Path, tool_runs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "image.tar"
    archive.write_text("no tar at all\n")
    digest = file_digest(archive)
    # Neither goes on before both looked for the entry and found nothing: however slow the machine, the second
    # acquire comes while the first's unpack is still under way, and waits for it.
    both_looked = threading.Barrier(2, timeout=60)
    look = cache._root_locked

    def looked(key: str) -> ImageRoot | None:
        found = look(key)
        both_looked.wait()
        return found

    monkeypatch.setattr(cache, "_root_locked", looked)
    results = await asyncio.gather(*(cache.acquire(archive, digest, "rootfs", h) for h in (HOLDER, OTHER)),
                                   return_exceptions=True)
    assert all(isinstance(r, ImageCacheError) for r in results) and tool_runs == ["tar"]
    assert cache.entries() == [] and leftovers(cache) == []


# --- pins and eviction ------------------------------------------------------------------------------------


def disk(monkeypatch: pytest.MonkeyPatch, total: int, used: int) -> None:
    """The cache's disk is `total` bytes, `used` of them used."""
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=total, used=used, free=total - used))


async def cached(cache: ImageCache, tmp_path: Path, name: str, holder: str, *, used: datetime) -> str:
    archive, digest = rootfs_tarball(tmp_path / f"{name}.tar", name)
    root = await cache.acquire(archive, digest, "rootfs", holder)
    os.utime(cache.entries_dir / root.key / "used", (used.timestamp(), used.timestamp()))
    return root.key


async def test_release_unpins_every_image_of_its_holder_and_nothing_else(
        cache: ImageCache, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    a = await cached(cache, tmp_path, "a", HOLDER, used=now)
    b = await cached(cache, tmp_path, "b", HOLDER, used=now)
    await cached(cache, tmp_path, "b", OTHER, used=now)
    assert cache.release(HOLDER)
    assert {h.key: h.pinned for h in cache.entries()} == {a: False, b: True}
    assert not cache.release(HOLDER)  # again: nothing happens
    assert not cache.release("job-000000000009/1/0/0")  # one that never held any
    assert {h.key: h.pinned for h in cache.entries()} == {a: False, b: True}


async def test_at_start_only_the_pins_of_ranks_still_using_an_image_stay(cache: ImageCache, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    a = await cached(cache, tmp_path, "a", HOLDER, used=now)
    b = await cached(cache, tmp_path, "b", OTHER, used=now)
    cache.unpin_all_but({HOLDER})  # OTHER's agent crashed and its rank is gone
    assert {h.key: h.pinned for h in cache.entries()} == {a: True, b: False}


async def test_unused_images_go_after_the_retention_but_pinned_ones_never(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    old = await cached(cache, tmp_path, "old", HOLDER, used=now - timedelta(days=8))
    in_use = await cached(cache, tmp_path, "in-use", OTHER, used=now - timedelta(days=30))
    recent = await cached(cache, tmp_path, "recent", HOLDER, used=now - timedelta(days=1))
    cache.release(HOLDER)
    disk(monkeypatch, total=10**12, used=10**9)
    assert cache.evict(POLICY, now=now) == [(old, "retention")]
    assert not (cache.entries_dir / old).exists() and leftovers(cache) == []
    assert sorted(h.key for h in cache.entries()) == sorted([in_use, recent])
    # Used again, it is unpacked again.
    again = await cache.acquire(tmp_path / "old.tar", file_digest(tmp_path / "old.tar"), "rootfs", HOLDER)
    assert again.cold and (again.rootfs / "etc/marker").read_text() == "old"


async def test_a_cache_past_its_high_watermark_loses_its_least_recently_used_images(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    oldest = await cached(cache, tmp_path, "oldest", HOLDER, used=now - timedelta(hours=3))
    pinned = await cached(cache, tmp_path, "pinned", OTHER, used=now - timedelta(hours=4))
    newer = await cached(cache, tmp_path, "newer", HOLDER, used=now - timedelta(hours=2))
    newest = await cached(cache, tmp_path, "newest", HOLDER, used=now - timedelta(hours=1))
    cache.release(HOLDER)
    each = cache.entries()[0].bytes
    assert all(h.bytes == each for h in cache.entries())
    # 4 entries on a disk of 5: above 50 %; at most 40 % (2 entries) may stay: the two least recently used
    # unpinned ones go, the pinned one, although older, stays.
    disk(monkeypatch, total=5 * each, used=4 * each)
    assert cache.evict(POLICY, now=now) == [(oldest, "watermark"), (newer, "watermark")]
    assert sorted(h.key for h in cache.entries()) == sorted([pinned, newest])


async def test_a_full_disk_has_unpinned_images_evicted_until_below_its_low_threshold(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    first = await cached(cache, tmp_path, "first", HOLDER, used=now - timedelta(hours=2))
    second = await cached(cache, tmp_path, "second", HOLDER, used=now - timedelta(hours=1))
    cache.release(HOLDER)
    each = cache.entries()[0].bytes
    disk(monkeypatch, total=100 * each, used=86 * each)  # 86 %: not yet pressure (90 %)
    assert cache.evict(POLICY, now=now) == []
    disk(monkeypatch, total=100 * each, used=95 * each)  # 95 %: down to 85 % would take 10, two are all there are
    assert cache.evict(POLICY, now=now) == [(first, "disk-pressure"), (second, "disk-pressure")]
    assert cache.entries() == []


async def test_an_image_pinned_after_it_was_listed_is_not_evicted(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    key = await cached(cache, tmp_path, "a", HOLDER, used=now - timedelta(days=8))
    cache.release(HOLDER)
    listed = cache.entries

    def listed_then_pinned() -> list[Held]:
        found = listed()
        cache._pin(key, OTHER)  # a job acquires it between the listing and the removal
        return found

    monkeypatch.setattr(cache, "entries", listed_then_pinned)
    disk(monkeypatch, total=10**12, used=10**9)
    assert cache.evict(POLICY, now=now) == []
    assert (cache.entries_dir / key / "rootfs/etc/marker").read_text() == "a"


async def test_an_entry_that_cannot_be_read_is_removed(
        cache: ImageCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    key = await cached(cache, tmp_path, "a", HOLDER, used=now)
    cache.release(HOLDER)
    (cache.entries_dir / key / "entry.json").write_text("{")
    assert cache.entries() == []
    disk(monkeypatch, total=10**12, used=10**9)
    assert cache.evict(POLICY, now=now) == [(key, "unreadable")]
    assert not (cache.entries_dir / key).exists()


# --- crashes ----------------------------------------------------------------------------------------------


def test_what_a_crash_left_half_unpacked_is_removed_at_start_but_not_an_unpack_under_way(tmp_path: Path) -> None:
    cache = ImageCache(tmp_path / "cache")
    cache.clean_partial()
    crashed = cache.partial_dir / "aaaaaaaaaaaaaaaaaaaaaaaa-0123abcd"
    (crashed / "rootfs/etc").mkdir(parents=True)
    (crashed / "rootfs/etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (crashed / "rootfs/etc").chmod(0o500)
    under_way = cache.partial_dir / "bbbbbbbbbbbbbbbbbbbbbbbb-4567cdef"
    (under_way / "rootfs").mkdir(parents=True)
    with (cache.locks_dir / "bbbbbbbbbbbbbbbbbbbbbbbb.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another agent sharing the folder is unpacking it
        ImageCache(tmp_path / "cache").clean_partial()
    assert leftovers(cache) == [under_way.name]
    shutil.rmtree(under_way)
