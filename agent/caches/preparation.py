"""Data preparation on a node (SPEC J14, D1, D2): a job's datasets copied into the node's cache before its
command starts, progress in the job's log, the cache kept to its policy and reported to the monitor.

The agent calls `prepare` for a rank whose launch has mounts to stage, before it builds the workspace: the
datasets are staged side by side (agent/caches/datacache.py), each pinned for the rank until `release`, and the
workspace mounts the local copies instead of shared storage. Every `PROGRESS_SECONDS` a line per copy
under way goes to the rank's output; a line per dataset says where it came from and how long it took.

`housekeeping` evicts what the policy says every `HOUSEKEEP_SECONDS` (and when woken), and says whether
the disk is under pressure; `reporting` publishes the whole cache to the monitor (`CacheReport` on
`agent_cache(node)`, JetStream) whenever it changed, with the node's unpacked images (J10). A cache of more
entries than a report carries sends its most recently used ones, and how many it holds: the monitor takes
none of the others for evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from agent.caches.datacache import DatasetCache, Progress, StagingError
from agent.caches.imageprep import ImagePreparation
from agent.caches.threadsafe import ThreadSafeEvent
from agent.output.tail import append_note
from libs.contracts.agent import StageDataset
from libs.contracts.datacache import (
    MAX_CACHE_ENTRIES_REPORTED,
    MAX_IMAGES_REPORTED,
    CachedImage,
    CacheReport,
    StagedDataset,
)
from libs.contracts.events import Mount
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
PROGRESS_SECONDS = 1.0
HOUSEKEEP_SECONDS = 30.0
REPORT_SETTLE_SECONDS = 0.5  # changes within this are sent in one report
Publish = Callable[[CacheReport, str], Awaitable[None]]  # a report and its message id


def holder_of(job_id: str, attempt: int, task: int, rank: int) -> str:
    return f"{job_id}/{attempt}/{task}/{rank}"


class DataPreparation:
    def __init__(self, cache: DatasetCache, node: str) -> None:
        self.cache = cache
        self.node = node
        self.wake = asyncio.Event()  # housekeeping is due now (a job ended, the policy changed)
        self._preloads: set[asyncio.Task[None]] = set()
        self._pinning: set[str] = set()  # who may hold pins: what ends without staging has nothing to release

    def keep_pins(self, holders: set[str]) -> None:
        """At start: the pins of `holders` (ranks that run on) stay, a crashed agent's others go."""
        self._pinning = self.cache.unpin_all_but(holders)

    async def prepare(self, mounts: Sequence[Mount], holder: str,
                      folder: Path) -> tuple[dict[str, Path], list[StagedDataset]]:
        """Stage every mount to stage; the local copy of each (by its source) and what was staged. Raises
        StagingError naming the dataset."""
        sources = list(dict.fromkeys(m.source for m in mounts if m.stage))
        self._pinning.add(holder)
        copying: list[Progress] = []
        say = _Notes(folder)
        say(f"data preparation: {len(sources)} dataset(s) into the cache of node {self.node}")

        def copy_begins(progress: Progress) -> None:
            copying.append(progress)
            say(f"data preparation: copying {progress.source}: {progress.total_bytes / 2**20:.1f} MiB in "
                f"{progress.total_files} file(s)")

        reporter = asyncio.create_task(self._progress(copying, say))
        try:
            results = await asyncio.gather(*(self.cache.stage(source, copy_begins, holder) for source in sources))
        finally:
            reporter.cancel()
        for _, staged in results:
            say(f"data preparation: {staged.source} ready: {staged.bytes / 2**20:.1f} MiB in {staged.files} file(s), "
                f"{'found in the cache' if staged.hit else 'copied'} in {staged.seconds:.1f} s")
        return {staged.source: path for path, staged in results}, [staged for _, staged in results]

    async def _progress(self, copying: list[Progress], say: Callable[[str], None]) -> None:
        while True:
            await asyncio.sleep(PROGRESS_SECONDS)
            for progress in copying:
                if progress.finished is None:
                    say(progress.line())

    def preload(self, request: StageDataset) -> None:
        """D2: copy a dataset into the cache in the background, for no job in particular (unpinned once made)."""
        task = asyncio.create_task(self._preload(request))
        self._preloads.add(task)
        task.add_done_callback(self._preloads.discard)

    async def _preload(self, request: StageDataset) -> None:
        holder = request.preload_id  # a preload's id, or the job a warm-up is for: what `trainyard cache` shows
        self._pinning.add(holder)
        try:
            _, staged = await self.cache.stage(request.source, lambda _: None, holder)
            log.info("cache.preloaded", node=self.node, source=request.source, hit=staged.hit,
                     seconds=staged.seconds)
        except StagingError as exc:
            log.warning("cache.preload_failed", node=self.node, source=request.source, error=str(exc))
            self.cache.failed(request.source, str(exc))
        finally:
            self.release(holder)

    def release(self, holder: str) -> None:
        """The rank ended: its copies may be evicted again (by the policy's next round)."""
        if holder in self._pinning:
            self._pinning.discard(holder)
            self.cache.unpin(holder)
            self.wake.set()

    async def housekeeping(self, on_pressure: Callable[[str | None], None]) -> None:
        """Evict by the policy, then tell `on_pressure` why the disk is under pressure (None: it is not)."""
        while True:
            try:
                pressured = await asyncio.to_thread(self.cache.housekeep, datetime.now(UTC))
                on_pressure(await asyncio.to_thread(self._pressure) if pressured else None)
            except OSError as exc:  # a disk that cannot be read now: the next round tries again
                log.warning("cache.housekeeping_failed", node=self.node, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), HOUSEKEEP_SECONDS)
            self.wake.clear()

    def _pressure(self) -> str:
        total, used = self.cache.disk()
        policy = self.cache.policy
        return (f"local disk {100 * used / total:.0f}% full (above {policy.disk_high_percent:g}%); takes work again "
                f"at or below {policy.disk_low_percent:g}%")

    async def reporting(self, publish: Publish, images: ImagePreparation | None = None) -> None:
        """Publish the whole cache whenever it changed (or the image cache of `images`), and every
        `PROGRESS_SECONDS` while copies are under way (so their progress shows); the evictions a report carries
        are then forgotten."""
        changes: list[asyncio.Event | ThreadSafeEvent] = [self.cache.changed]
        if images is not None:
            changes.append(images.changed)
        while True:
            if self.cache.copying():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_any_set(changes), PROGRESS_SECONDS)
            else:
                await _any_set(changes)
                await asyncio.sleep(REPORT_SETTLE_SECONDS)
            for changed in changes:
                changed.clear()
            evicted = self.cache.evicted[:MAX_CACHE_ENTRIES_REPORTED]  # the rest go with the next report
            if len(self.cache.evicted) > len(evicted):
                self.cache.changed.set()
            # The most recently used when there are more: the report says how many, so that the monitor takes
            # none of the others for evicted.
            held = await asyncio.to_thread(self.cache.entries)
            unpacked: list[CachedImage] = await asyncio.to_thread(images.cache.images) if images else []
            total, used = await asyncio.to_thread(self.cache.disk)
            report = CacheReport(node=self.node, sent_at=datetime.now(UTC), entries=held[:MAX_CACHE_ENTRIES_REPORTED],
                                 evicted=evicted, disk_bytes=total, used_bytes=used, copying=self.cache.copying(),
                                 failures=list(self.cache.failures), total_entries=len(held),
                                 images=unpacked[:MAX_IMAGES_REPORTED])
            await publish(report, f"{self.node}.cache.{time.time_ns()}")
            del self.cache.evicted[:len(evicted)]


async def _any_set(events: Sequence[asyncio.Event | ThreadSafeEvent]) -> None:
    """Until one of `events` is set."""
    waiting = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waiting:
            task.cancel()


class _Notes:
    """Lines of the agent's own in a rank's output (the folder is made on first use)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, text: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        append_note(self.folder, text)
