"""A node's dataset cache (SPEC J14, D1, D2): keyed by content, copied once and verified, reused, pinned while
used, evicted by retention and watermarks, and a disk under pressure that does not flap."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.caches import datacache
from agent.caches.cachepolicy import Held, SourceFile, cache_key, evictions, under_pressure
from agent.caches.datacache import DatasetCache, Progress, StagingError
from agent.caches.preparation import DataPreparation
from libs.contracts.datacache import MAX_CACHE_ENTRIES_REPORTED, CacheEviction, CachePolicy, CacheReport
from libs.contracts.events import Mount
from tests.support.strategies import SETTINGS

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
HOLDER = "job-000000000001/1/0/0"
GIB = 2**30
POLICY = CachePolicy(retention_seconds=7 * 86400, high_percent=50, low_percent=40, disk_high_percent=90,
                     disk_low_percent=85)


# --- keys ---------------------------------------------------------------------------------------------------


def test_a_dataset_changed_in_shared_storage_is_a_new_entry_and_an_unchanged_one_the_same() -> None:
    files = [SourceFile("a.bin", 10, 1), SourceFile("b/c.txt", 3, 2)]
    key = cache_key("datasets/imgs/v1", files)
    assert len(key) == 24 and key == cache_key("datasets/imgs/v1", list(reversed(files)))
    assert cache_key("datasets/imgs/v1", [SourceFile("a.bin", 11, 1), files[1]]) != key  # grew
    assert cache_key("datasets/imgs/v1", [SourceFile("a.bin", 10, 5), files[1]]) != key  # rewritten
    assert cache_key("datasets/imgs/v1", files[:1]) != key  # a file removed
    assert cache_key("datasets/imgs/v2", files) != key  # another version


# --- the policy -----------------------------------------------------------------------------------------------


def held(key: str, gib: float, hours_ago: float, pinned: bool = False) -> Held:
    return Held(key=key, bytes=int(gib * GIB), last_used=NOW - timedelta(hours=hours_ago), pinned=pinned)


def test_entries_unused_past_the_retention_go_unless_pinned() -> None:
    entries = [held("old", 1, 8 * 24), held("old-pinned", 1, 9 * 24, pinned=True), held("recent", 1, 1)]
    assert evictions(entries, POLICY, disk_bytes=100 * GIB, disk_used_bytes=10 * GIB, now=NOW) == [("old", "retention")]


def test_above_the_high_watermark_the_least_recently_used_go_down_to_the_low_one() -> None:
    # 100 GiB disk: the cache may hold 50 GiB, and is cut to 40 GiB when it holds more.
    entries = [held("a", 20, 1), held("b", 20, 5, pinned=True), held("c", 15, 3), held("d", 10, 4)]
    chosen = evictions(entries, POLICY, disk_bytes=100 * GIB, disk_used_bytes=70 * GIB, now=NOW)
    assert chosen == [("d", "watermark"), ("c", "watermark")]  # b is older but pinned
    at_the_line = [entries[0], entries[1], entries[3]]  # 50 GiB: not above the high watermark
    assert evictions(at_the_line, POLICY, disk_bytes=100 * GIB, disk_used_bytes=70 * GIB, now=NOW) == []


def test_a_disk_under_pressure_has_unpinned_entries_evicted_down_to_its_low_threshold() -> None:
    entries = [held("a", 2, 1), held("b", 3, 2), held("c", 4, 3, pinned=True)]
    chosen = evictions(entries, POLICY, disk_bytes=100 * GIB, disk_used_bytes=92 * GIB, now=NOW)
    assert chosen == [("b", "disk-pressure"), ("a", "disk-pressure")]  # 92 - 3 = 89, - 2 = 87: still above 85


def test_disk_pressure_does_not_flap_between_its_thresholds() -> None:
    def pressured(percent: int, was: bool) -> bool:
        return under_pressure(percent * GIB, 100 * GIB, POLICY, was=was)

    assert not pressured(89, was=False) and pressured(91, was=False)
    assert pressured(88, was=True)  # between the thresholds: stays as it was
    assert not pressured(85, was=True) and not pressured(88, was=False)


entries_strategy = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 400), st.booleans()), max_size=12)


@settings(SETTINGS, max_examples=200)
@given(entries_strategy, st.integers(0, 100))
def test_eviction_never_takes_a_pinned_entry_and_takes_the_least_recently_used_first(
        shapes: list[tuple[int, int, bool]], other_gib: int) -> None:
    entries = [held(f"e{i}", gib, hours, pinned) for i, (gib, hours, pinned) in enumerate(shapes)]
    cached = sum(e.bytes for e in entries)
    chosen = evictions(entries, POLICY, disk_bytes=200 * GIB, disk_used_bytes=cached + other_gib * GIB, now=NOW)
    by_key = {e.key: e for e in entries}
    assert not any(by_key[key].pinned for key, _ in chosen)
    assert len({key for key, _ in chosen}) == len(chosen)
    kept = [e for e in entries if e.key not in {key for key, _ in chosen}]
    by_size = [by_key[key] for key, cause in chosen if cause != "retention"]
    assert all(a.last_used <= b.last_used for a, b in itertools.pairwise(by_size))
    unpinned_left = [e for e in kept if not e.pinned]
    if unpinned_left and by_size:  # what is kept is more recently used than what size pushed out
        assert max(e.last_used for e in by_size) <= min(e.last_used for e in unpinned_left)
    # What is kept fits under the watermark and the disk's threshold, unless only pinned entries are left.
    kept_bytes = sum(e.bytes for e in kept)
    used_after = kept_bytes + other_gib * GIB
    assert kept_bytes <= 200 * GIB * POLICY.high_percent / 100 or not unpinned_left
    assert used_after <= 200 * GIB * POLICY.disk_high_percent / 100 or not unpinned_left


# --- the cache on disk -------------------------------------------------------------------------------------------


def dataset(storage: Path, name: str, files: dict[str, bytes]) -> str:
    for path, content in files.items():
        target = storage / "datasets" / name / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return f"datasets/{name}"


@pytest.fixture
def cache(tmp_path: Path) -> DatasetCache:
    opened = DatasetCache(tmp_path / "cache", tmp_path / "storage", workers=3)
    opened.open()
    return opened


async def test_a_dataset_is_copied_once_verified_read_only_and_reused(cache: DatasetCache) -> None:
    source = dataset(cache.storage, "imgs", {"a.bin": b"x" * 3_000_000, "labels/b.txt": b"cat\n"})
    seen: list[Progress] = []
    local, first = await cache.stage(source, seen.append, HOLDER)
    assert (local / "a.bin").read_bytes() == b"x" * 3_000_000 and (local / "labels" / "b.txt").read_text() == "cat\n"
    assert (first.hit, first.bytes, first.files) == (False, 3_000_004, 2)
    assert seen[0].done_bytes == 3_000_004
    assert seen[0].line().startswith("data preparation: datasets/imgs 2.9/2.9 MiB (") and "MiB/s" in seen[0].line()
    assert not os.access(local / "a.bin", os.W_OK) or os.geteuid() == 0
    assert oct((local / "a.bin").stat().st_mode & 0o777) == "0o444"

    again, second = await cache.stage(source, seen.append, HOLDER)
    assert again == local and second.hit and second.key == first.key and len(seen) == 1  # nothing copied
    [entry] = cache.entries()
    assert (entry.source, entry.bytes, entry.files) == (source, 3_000_004, 2)


async def test_jobs_staging_the_same_dataset_at_once_share_one_copy(cache: DatasetCache,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    source = dataset(cache.storage, "shared", {f"f{i}": os.urandom(200_000) for i in range(6)})
    copies: list[str] = []
    real = datacache.copy_verified

    def counting(listing: datacache.Listing, file: SourceFile, dst: Path, progress: Progress,
                 throttle: datacache.Throttle) -> str:
        copies.append(file.path)
        return real(listing, file, dst, progress, throttle)

    monkeypatch.setattr(datacache, "copy_verified", counting)
    staged = await asyncio.gather(*(cache.stage(source, lambda _: None, HOLDER) for _ in range(3)))
    assert sorted(copies) == [f"f{i}" for i in range(6)]  # each file once
    assert sorted(s.hit for _, s in staged) == [False, True, True]
    assert len({path for path, _ in staged}) == 1


async def test_a_changed_dataset_is_copied_again_and_the_old_copy_is_left_to_the_policy(cache: DatasetCache) -> None:
    source = dataset(cache.storage, "imgs", {"a.txt": b"one"})
    old, first = await cache.stage(source, lambda _: None, HOLDER)
    (cache.storage / source / "a.txt").write_bytes(b"two!")
    new, second = await cache.stage(source, lambda _: None, HOLDER)
    assert new != old and not second.hit and (new / "a.txt").read_bytes() == b"two!"
    assert (old / "a.txt").read_bytes() == b"one"  # a job still reading the old copy keeps it
    assert {e.key for e in cache.entries()} == {first.key, second.key}


async def test_a_partial_copy_a_crash_left_is_removed_at_start_and_never_used(cache: DatasetCache) -> None:
    source = dataset(cache.storage, "imgs", {"a.txt": b"whole"})
    key = cache_key(source, datacache.list_source(cache.storage, source).files)
    crashed = cache.partial_dir / f"{key}-0badc0de" / "data"
    crashed.mkdir(parents=True)
    (crashed / "a.txt").write_bytes(b"wh")  # half a copy
    cache.open()  # the agent starts again
    assert not any(cache.partial_dir.iterdir())
    local, staged = await cache.stage(source, lambda _: None, HOLDER)
    assert not staged.hit and (local / "a.txt").read_bytes() == b"whole"


async def test_a_missing_dataset_fails_with_its_name(cache: DatasetCache) -> None:
    with pytest.raises(StagingError, match="datasets/nowhere"):
        await cache.stage("datasets/nowhere", lambda _: None, HOLDER)


async def test_a_pinned_entry_is_kept_past_its_retention_and_evicted_once_unpinned(cache: DatasetCache) -> None:
    source = dataset(cache.storage, "imgs", {"a.txt": b"data"})
    _, staged = await cache.stage(source, lambda _: None, HOLDER)
    cache.pin(staged.key, "job-000000000001/1/0/0")
    cache.policy = CachePolicy(retention_seconds=60)
    later = datetime.now(UTC) + timedelta(hours=1)
    assert not cache.housekeep(later)
    assert [e.pins for e in cache.entries()] == [["job-000000000001/1/0/0"]]

    cache.unpin("job-000000000001/1/0/0")
    cache.housekeep(later)
    assert cache.entries() == []
    [evicted] = cache.evicted
    assert (evicted.key, evicted.cause, evicted.source) == (staged.key, "retention", source)


def test_a_disk_fuller_than_the_policy_allows_puts_the_node_under_pressure_until_below_the_low_threshold(
        cache: DatasetCache) -> None:
    total, used = cache.disk()
    percent = 100 * used / total
    cache.policy = CachePolicy(disk_high_percent=max(percent - 1, 0.5), disk_low_percent=max(percent - 2, 0.1))
    assert cache.housekeep(datetime.now(UTC))
    cache.policy = CachePolicy(disk_high_percent=min(percent + 2, 100), disk_low_percent=min(percent + 1, 100))
    assert not cache.housekeep(datetime.now(UTC))


def test_a_rate_limit_is_shared_by_every_copying_thread() -> None:
    throttle = datacache.Throttle(10 * 2**20)  # 10 MiB/s
    started = time.monotonic()
    threads = [threading.Thread(target=throttle.take, args=(2**20,)) for _ in range(5)]  # 5 MiB in all
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started >= 0.39  # the fifth MiB waits for the four before it


async def test_a_cache_the_node_cannot_write_is_the_nodes_fault_and_a_missing_dataset_is_not(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache should be")
    storage = tmp_path / "storage"
    source = dataset(storage, "imgs", {"a.txt": b"data"})
    broken = DatasetCache(blocked / "cache", storage)
    broken.open()  # says so, and the agent goes on
    with pytest.raises(StagingError) as failed:
        await broken.stage(source, lambda _: None, HOLDER)
    assert failed.value.node_fault and "cannot write the cache" in str(failed.value)

    healthy = DatasetCache(tmp_path / "cache", storage)
    healthy.open()
    with pytest.raises(StagingError) as missing:
        await healthy.stage("datasets/gone", lambda _: None, HOLDER)
    assert not missing.value.node_fault


async def test_evictions_beyond_a_reports_bound_go_with_the_next_report(cache: DatasetCache) -> None:
    gone = [CacheEviction(key=f"{i:024x}", source="datasets/old", bytes=1, cause="retention", evicted_at=NOW)
            for i in range(MAX_CACHE_ENTRIES_REPORTED + 7)]
    cache.evicted.extend(gone)
    cache.changed.set()
    reports: list[CacheReport] = []

    async def publish(report: CacheReport, _: str) -> None:
        reports.append(report)

    reporting = asyncio.create_task(DataPreparation(cache, "node-a").reporting(publish))
    async with asyncio.timeout(10):
        while len(reports) < 2:
            await asyncio.sleep(0.05)
    reporting.cancel()
    assert [len(r.evicted) for r in reports] == [MAX_CACHE_ENTRIES_REPORTED, 7]
    assert [e for r in reports for e in r.evicted] == gone and cache.evicted == []


async def test_a_ranks_pins_go_when_it_ends_even_after_a_restart_and_one_that_staged_nothing_wakes_nothing(
        cache: DatasetCache, tmp_path: Path) -> None:
    source = dataset(cache.storage, "imgs", {"a.txt": b"data"})
    staging = DataPreparation(cache, "node-a")
    others = ["job-000000000002/1/0/0", "job-000000000003/1/0/0"]
    for holder in (HOLDER, *others):
        await staging.prepare([Mount(source=source, target="dataset/private/imgs", read_only=True, stage=True)], holder,
                              tmp_path / holder.replace("/", "-"))
    staging.release(others[0])
    assert [e.pins for e in cache.entries()] == [[HOLDER, others[1]]]
    assert staging.wake.is_set()  # its copy may be evicted now

    restarted = DataPreparation(cache, "node-a")  # the agent started again: HOLDER's rank runs on
    restarted.keep_pins({HOLDER})
    assert [e.pins for e in cache.entries()] == [[HOLDER]]  # the rank that ended meanwhile lost its pin
    restarted.release("job-000000000009/1/0/0")  # staged nothing
    assert not restarted.wake.is_set()
    restarted.release(HOLDER)
    assert [e.pins for e in cache.entries()] == [[]] and restarted.wake.is_set()


async def test_a_change_made_in_a_worker_thread_wakes_the_waiting_report_at_once(cache: DatasetCache) -> None:
    source = dataset(cache.storage, "tiny", {"a.bin": b"1"})
    _, staged = await cache.stage(source, lambda progress: None, HOLDER)
    cache.changed.clear()
    waiting = asyncio.create_task(cache.changed.wait())  # the node's cache report, waiting for a change
    await asyncio.sleep(0)
    began = time.monotonic()
    # Pinned in a thread, as the cache's blocking work runs, the loop hearing nothing else meanwhile.
    threading.Thread(target=cache.pin, args=(staged.key, "job-000000000002/1/0/0")).start()
    await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - began < 5  # woken by the change, not by whatever woke the loop next (its timeout)
