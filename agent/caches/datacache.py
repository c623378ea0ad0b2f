"""A node's dataset cache on its local disk (SPEC J14, D1, D2): copies made once, verified, reused.

    <cache>/entries/<key>/data/…      a dataset folder as it was copied (read-only files)
    <cache>/entries/<key>/entry.json  what it is: source, size, files, checksum, when copied
    <cache>/entries/<key>/used        touched at every use: its modification time is the last use
    <cache>/pins/<key>/<holder>       one file per rank using it; an entry with pins is never removed
    <cache>/partial/<key>-<random>/   copies being made; an entry exists only once renamed into entries/
    <cache>/locks/<key>.lock          held while an entry is fetched: one fetch per entry per node, also
                                      between agents sharing a cache folder

A copy is made file by file by a bounded pool of workers shared by every job on the node, so a job's
datasets and the files of a large one are copied side by side (D2). Each file is hashed as it is read
from shared storage and again as written, and its size is checked against the listing; the folder is
listed again once done, and a dataset that changed meanwhile is not kept. Only then is the copy renamed
into place, in one step: a crash mid-copy leaves a partial folder, which is removed at the next start and
never used. What the cache keeps is decided by agent/caches/cachepolicy.py.

A copy never leaves its dataset: the folder is walked, and each file opened, one step at a time from the
dataset's folder without following a link, so what is read is what was listed, whatever is swapped in
meanwhile. A link is copied as a link, as listed, and only once every link of the listing is known to lead
to a place inside the dataset (cachepolicy.links_refused); a dataset with one that does not is refused,
naming it, before anything is copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from agent.caches.cachefiles import (
    FOLDER_FLAGS,
    holder_of_pin,
    locked,
    open_beneath,
    open_file_beneath,
    pin_name,
    remove_folder,
)
from agent.caches.cachepolicy import Held, SourceFile, cache_key, evictions, links_refused, under_pressure
from agent.caches.threadsafe import ThreadSafeEvent
from libs.contracts.datacache import (
    CacheEntry,
    CacheEviction,
    CachePolicy,
    CopyUnderWay,
    EvictionCause,
    StagedDataset,
    StagingFailed,
)
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import CACHE_REQUESTS, CACHE_SIZE, SampledGauge, counter

log = get_logger(__name__)
_requests = counter(CACHE_REQUESTS)
_size = SampledGauge(CACHE_SIZE)
CHUNK = 1024 * 1024
DEFAULT_WORKERS = 4
WORKERS_VARIABLE = "TRAINYARD_STAGE_WORKERS"
# At most this many MiB a second read from shared storage for staging, all copies together (unset: no limit),
# so that staging does not starve the jobs reading shared storage directly.
RATE_VARIABLE = "TRAINYARD_STAGE_MIB_PER_SECOND"
CACHE_VARIABLE = "TRAINYARD_DATA_CACHE"
FAILURES_KEPT = 20


class StagingError(Exception):
    """A dataset could not be copied; the message names it and why."""

    node_fault = False  # the node is at fault (its disk), not the dataset: another node may do


class NodeStagingError(StagingError):
    """The node's own disk failed the copy (full, read-only, unreadable back): another node may do."""

    node_fault = True


class Throttle:
    """Shares a rate among the copying threads: each chunk waits for its turn (bytes per second)."""

    def __init__(self, bytes_per_second: float | None) -> None:
        self.rate = bytes_per_second
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, count: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + count / self.rate
        time.sleep(max(0.0, start - now))


UNLIMITED = Throttle(None)


@contextlib.contextmanager
def _failing_as(error: type[StagingError], what: str) -> Iterator[None]:
    """An OSError inside is `error` ("<what>: <why>"): the dataset's fault or the node's."""
    try:
        yield
    except OSError as exc:
        raise error(f"{what}: {exc.strerror or exc}") from exc


@dataclass
class Progress:
    """How far one dataset's copy is (updated from the copying threads)."""

    source: str
    total_bytes: int
    total_files: int
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    done_bytes: int = 0
    finished: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, count: int) -> None:
        with self._lock:
            self.done_bytes += count

    def line(self) -> str:
        elapsed = max((self.finished or time.monotonic()) - self.started, 1e-6)
        rate = self.done_bytes / elapsed / 2**20
        return (f"data preparation: {self.source} {self.done_bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB "
                f"({rate:.1f} MiB/s)")


@dataclass(frozen=True)
class Listing:
    """A dataset folder as listed: shared storage's real path, the folder's real path inside it, and its files
    and links (walked without following a link)."""

    storage: str
    folder: str
    files: tuple[SourceFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def file_count(self) -> int:
        """Plain files: links are not counted, what they lead to is."""
        return sum(1 for f in self.files if f.link is None)

    def shown(self, file: SourceFile) -> str:
        return os.path.join(self.storage, self.folder, file.path)


def list_source(storage: Path, source: str) -> Listing:
    """Every plain file and link under the dataset folder `source` of shared storage, walked from descriptors
    without following links. The folder itself may be a link inside shared storage; a link of the dataset that
    does not stay inside it is refused (StagingError naming it: nothing is copied)."""
    root, real = os.path.realpath(storage), os.path.realpath(storage / source)
    if os.path.commonpath([root, real]) != root or real == root:
        raise StagingError(f"refused {source}: a link that leads out of its place in shared storage (to {real})")
    folder = os.path.relpath(real, root)
    try:
        descriptor = open_beneath(root, folder, FOLDER_FLAGS)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise StagingError(f"{source} is not a folder in shared storage") from exc
    try:
        files = tuple(sorted(_walk(descriptor, ""), key=lambda f: f.path))
    finally:
        os.close(descriptor)
    if refused := links_refused(files, real):
        path, why = refused[0]
        more = f" (and {len(refused) - 1} other link(s))" if len(refused) > 1 else ""
        raise StagingError(f"refused {source}/{path}: a link that {why}{more}")
    return Listing(storage=root, folder=folder, files=files)


def _walk(folder: int, prefix: str) -> Iterator[SourceFile]:
    """The plain files and links under an open folder; each subfolder is opened from it, never through a link
    (one swapped in meanwhile fails the open). Anything else (FIFOs, sockets, devices) is left out."""
    with os.scandir(folder) as found:
        entries = list(found)
    for entry in entries:
        path = prefix + entry.name
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            yield SourceFile(path=path, size=0, mtime_ns=info.st_mtime_ns, link=os.readlink(entry.name, dir_fd=folder))
        elif stat.S_ISREG(info.st_mode):
            yield SourceFile(path=path, size=info.st_size, mtime_ns=info.st_mtime_ns)
        elif stat.S_ISDIR(info.st_mode):
            inner = os.open(entry.name, FOLDER_FLAGS, dir_fd=folder)
            try:
                yield from _walk(inner, f"{path}/")
            finally:
                os.close(inner)


def copy_verified(listing: Listing, file: SourceFile, target: Path, progress: Progress,
                  throttle: Throttle = UNLIMITED) -> str:
    """Copy one file of a listing, hashing what is read and, once on disk, what was written; its digest. The
    file is opened from the dataset's folder without following links: a link put in its place (or in a folder's)
    since it was listed fails the copy. A link is made as the link listed (and checked), never followed. What
    fails on the node's side (writing, reading back) is a NodeStagingError; on shared storage's, a StagingError."""
    if file.link is not None:
        return _copy_link(file.link, target)
    source = listing.shown(file)
    reading = partial(_failing_as, StagingError, f"cannot read {source}")  # a context each time: they are single-use
    writing = partial(_failing_as, NodeStagingError, f"cannot write {target}")
    read = hashlib.sha256()
    try:
        descriptor = open_file_beneath(listing.storage, f"{listing.folder}/{file.path}")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EINVAL):
            raise StagingError(f"{source} changed while it was copied: it is no longer a plain file of the "
                               "dataset") from exc
        raise StagingError(f"cannot read {source}: {exc.strerror or exc}") from exc
    with open(descriptor, "rb") as src:
        with writing():
            target.parent.mkdir(parents=True, exist_ok=True)
            dst = target.open("wb")
        with dst:
            while True:
                with reading():
                    chunk = src.read(CHUNK)
                if not chunk:
                    break
                throttle.take(len(chunk))
                read.update(chunk)
                with writing():
                    dst.write(chunk)
                progress.add(len(chunk))
            with writing():
                dst.flush()
                os.fsync(dst.fileno())
    written = hashlib.sha256()
    with _failing_as(NodeStagingError, f"cannot read back {target}"):
        with target.open("rb") as check:
            while chunk := check.read(CHUNK):
                written.update(chunk)
        copied = target.stat().st_size
    if copied != file.size:
        raise StagingError(f"{source} changed while it was copied ({file.size} bytes listed, {copied} copied)")
    if written.digest() != read.digest():
        raise NodeStagingError(f"the copy of {source} does not read back as written")
    return read.hexdigest()


def _copy_link(link: str, target: Path) -> str:
    """Make a link of the copy, as listed; its digest covers what it leads to by name."""
    with _failing_as(NodeStagingError, f"cannot write {target}"):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link, target)
        if os.readlink(target) != link:
            raise NodeStagingError(f"the copy of link {target} does not read back as written")
    return hashlib.sha256(f"link\0{link}".encode()).hexdigest()


def _read_only(folder: Path) -> None:
    for path in folder.rglob("*"):  # links are not descended into
        if not path.is_symlink():  # a link's mode means nothing, and chmod would follow it
            path.chmod(0o555 if path.is_dir() else 0o444)


@dataclass
class _Fetch:
    progress: Progress
    task: asyncio.Task[tuple[CacheEntry, bool]]


class DatasetCache:
    def __init__(self, root: Path, storage: Path, *, workers: int = DEFAULT_WORKERS,
                 mib_per_second: float | None = None) -> None:
        self.root, self.storage = root, storage
        self.entries_dir, self.partial_dir = root / "entries", root / "partial"
        self.pins_dir, self.locks_dir = root / "pins", root / "locks"
        self.policy = CachePolicy()
        self.pressured = False  # the disk is under pressure (D1): the node takes no new work
        self.changed = ThreadSafeEvent()  # something a report shows changed; set from the copying threads too
        self.evicted: list[CacheEviction] = []  # since the last report
        self.failures: deque[StagingFailed] = deque(maxlen=FAILURES_KEPT)  # preloads that failed, newest last
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage")
        self._throttle = Throttle(mib_per_second * 2**20 if mib_per_second else None)
        self._fetching: dict[str, _Fetch] = {}  # copies under way, by key

    @classmethod
    def from_environment(cls, agent_root: Path, storage: Path) -> DatasetCache:
        root = Path(os.environ.get(CACHE_VARIABLE) or agent_root / "dataset-cache")
        rate = os.environ.get(RATE_VARIABLE)
        return cls(root, storage, workers=int(os.environ.get(WORKERS_VARIABLE, DEFAULT_WORKERS)),
                   mib_per_second=float(rate) if rate else None)

    def open(self) -> None:
        """At start: partial copies a crash left are removed, never used. A cache that cannot be made is
        said and left: jobs without data preparation still run, and a staging there fails as the node's."""
        try:
            for folder in (self.entries_dir, self.partial_dir, self.pins_dir, self.locks_dir):
                folder.mkdir(parents=True, exist_ok=True)
            for partial in self.partial_dir.iterdir():
                with contextlib.suppress(OSError):
                    remove_folder(partial)
        except OSError as exc:
            log.error("cache.unusable", root=str(self.root), error=str(exc))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- staging --------------------------------------------------------------------------------------

    async def stage(self, source: str, on_copy: Callable[[Progress], None],
                    holder: str) -> tuple[Path, StagedDataset]:
        """The local copy of dataset folder `source` (relative to shared storage), pinned for `holder`, made now
        unless the cache has it. A copy is made once per node, by a task of its own that no caller's end
        cancels; every caller waiting for it gets its progress through `on_copy`."""
        started = time.monotonic()
        listing = await self._listing(source)
        key = cache_key(source, listing.files)
        with self._writing_the_cache():  # pinned before it is looked for: no eviction takes it after
            await asyncio.to_thread(self.pin, key, holder)
        entry = await asyncio.to_thread(self._entry, key)
        copied = False
        if entry is None:
            fetch = self._fetching.get(key)
            if fetch is None:
                progress = Progress(source=source, total_bytes=listing.total_bytes, total_files=listing.file_count)
                fetch = self._fetching[key] = _Fetch(progress, asyncio.create_task(
                    self._fetch(source, key, listing, progress)))
                fetch.task.add_done_callback(lambda _: self._fetching.pop(key, None))
                copied = True
            on_copy(fetch.progress)
            made, fresh = await asyncio.shield(fetch.task)
            entry, copied = made, copied and fresh
        await asyncio.to_thread(self._touch, key)
        staged = StagedDataset(source=source, key=key, bytes=entry.bytes, files=entry.files, hit=not copied,
                               seconds=round(time.monotonic() - started, 3))
        _requests.add(1, {"trainyard.cache.result": "miss" if copied else "hit"})
        return self.entries_dir / key / "data", staged

    async def _fetch(self, source: str, key: str, listing: Listing,
                     progress: Progress) -> tuple[CacheEntry, bool]:
        """Copy under the entry's lock; the entry, and whether it was copied now (not by another agent sharing
        the cache meanwhile)."""
        loop = asyncio.get_running_loop()
        lock = self.locks_dir / f"{key}.lock"
        held = contextlib.ExitStack()
        try:
            await asyncio.to_thread(held.enter_context, locked(lock))
            made = await asyncio.to_thread(self._entry, key)
            if made is not None:
                return made, False
            partial = self.partial_dir / f"{key}-{secrets.token_hex(4)}"
            with self._writing_the_cache():
                partial.mkdir(parents=True)
            try:
                # Every copy ends before a failure is raised: none writes into a folder being removed.
                results = await asyncio.gather(*(
                    loop.run_in_executor(self._pool, copy_verified, listing, f, partial / "data" / f.path, progress,
                                         self._throttle)
                    for f in listing.files), return_exceptions=True)
                if failed := next((r for r in results if isinstance(r, BaseException)), None):
                    raise failed
                digests = [r for r in results if isinstance(r, str)]
                progress.finished = time.monotonic()
                if await self._listing(source) != listing:
                    raise StagingError(f"{source} changed in shared storage while it was copied")
                return await asyncio.to_thread(self._commit, key, source, listing, digests, partial), True
            except BaseException:
                await asyncio.to_thread(remove_folder, partial)
                raise
        except OSError as exc:  # the cache's own folders (its lock, renaming into place): the node's disk
            raise NodeStagingError(f"cannot copy {source} into the cache at {self.root}: {exc}") from exc
        finally:
            await asyncio.to_thread(held.close)

    async def _listing(self, source: str) -> Listing:
        with _failing_as(StagingError, f"cannot list {source} in shared storage"):
            return await asyncio.to_thread(list_source, self.storage, source)

    def _writing_the_cache(self) -> contextlib.AbstractContextManager[None]:
        return _failing_as(NodeStagingError, f"cannot write the cache at {self.root}")

    def _commit(self, key: str, source: str, listing: Listing, digests: list[str], partial: Path) -> CacheEntry:
        checksum = hashlib.sha256("".join(digests).encode()).hexdigest()
        now = datetime.now(UTC)
        entry = CacheEntry(key=key, source=source, bytes=listing.total_bytes, files=listing.file_count, staged_at=now,
                           last_used=now)
        (partial / "data").mkdir(exist_ok=True)  # an empty dataset is a folder too
        (partial / "entry.json").write_text(json.dumps({"key": key, "source": source, "bytes": entry.bytes,
                                                        "files": entry.files, "sha256": checksum,
                                                        "staged_at": now.isoformat()}))
        (partial / "used").touch()
        _read_only(partial / "data")
        os.rename(partial, self.entries_dir / key)  # atomic: the entry exists whole or not at all
        self.changed.set()
        log.info("cache.staged", key=key, source=source, bytes=entry.bytes, files=entry.files)
        return entry

    def _entry(self, key: str) -> CacheEntry | None:
        folder = self.entries_dir / key
        try:
            found = json.loads((folder / "entry.json").read_text())
            used = datetime.fromtimestamp((folder / "used").stat().st_mtime, UTC)
            pins = sorted(p.name for p in (self.pins_dir / key).iterdir()) if (self.pins_dir / key).is_dir() else []
            return CacheEntry(key=key, source=found["source"], bytes=found["bytes"], files=found["files"],
                              staged_at=datetime.fromisoformat(found["staged_at"]), last_used=used,
                              pins=[holder_of_pin(pin) for pin in pins])
        except (OSError, ValueError, KeyError):
            return None

    def _touch(self, key: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.entries_dir / key / "used")
        self.changed.set()

    def copying(self) -> list[CopyUnderWay]:
        """The copies under way, and how far each is."""
        return [CopyUnderWay(source=fetch.progress.source, key=key, done_bytes=fetch.progress.done_bytes,
                             total_bytes=fetch.progress.total_bytes, started_at=fetch.progress.started_at)
                for key, fetch in self._fetching.items()]

    def failed(self, source: str, reason: str) -> None:
        self.failures.append(StagingFailed(source=source, reason=reason, failed_at=datetime.now(UTC)))
        self.changed.set()

    # --- pins -----------------------------------------------------------------------------------------

    def pin(self, key: str, holder: str) -> None:
        """`holder` (<job>/<attempt>/<task>/<rank>) uses the entry: it is not removed until unpinned."""
        folder = self.pins_dir / key
        folder.mkdir(parents=True, exist_ok=True)
        (folder / pin_name(holder)).touch()
        self.changed.set()

    def unpin(self, holder: str) -> None:
        """`holder` uses no entry any more."""
        for pin in self.pins_dir.glob(f"*/{pin_name(holder)}"):
            with contextlib.suppress(OSError):
                pin.unlink()
            self.changed.set()

    def unpin_all_but(self, holders: set[str]) -> set[str]:
        """At start: pins of ranks that no longer run here are gone (a crashed agent's). Those of `holders`
        that hold pins."""
        kept = set()
        for pin in self.pins_dir.glob("*/*"):
            if (holder := holder_of_pin(pin.name)) in holders:
                kept.add(holder)
                continue
            with contextlib.suppress(OSError):
                pin.unlink()
        return kept

    # --- inventory, eviction, pressure ----------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Every entry, the most recently used first."""
        found = [entry for folder in sorted(self.entries_dir.iterdir()) if (entry := self._entry(folder.name))]
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def disk(self) -> tuple[int, int]:
        """The size of the disk the cache is on, and what is used there."""
        usage = shutil.disk_usage(self.root)
        return usage.total, usage.used

    def housekeep(self, now: datetime) -> bool:
        """Evict what the policy says (blocking: run it in a thread); whether the disk is still under pressure."""
        entries = self.entries()
        total, used = self.disk()
        held = [Held(key=e.key, bytes=e.bytes, last_used=e.last_used, pinned=bool(e.pins)) for e in entries]
        by_key = {e.key: e for e in entries}
        evicted: set[str] = set()
        for key, cause in evictions(held, self.policy, disk_bytes=total, disk_used_bytes=used, now=now):
            if key not in self._fetching and self._evict(by_key[key], cause, now):
                evicted.add(key)
        total, used = self.disk()
        self.pressured = under_pressure(used, total, self.policy, was=self.pressured)
        _size.set(sum(e.bytes for e in entries if e.key not in evicted))
        return self.pressured

    def _evict(self, entry: CacheEntry, cause: EvictionCause, now: datetime) -> bool:
        """Whether it was evicted (it was not pinned since it was listed)."""
        with locked(self.locks_dir / f"{entry.key}.lock"):
            if (self.pins_dir / entry.key).is_dir() and any((self.pins_dir / entry.key).iterdir()):
                return False  # pinned since it was listed
            doomed = self.partial_dir / f"{entry.key}-evicted-{secrets.token_hex(4)}"
            try:
                os.rename(self.entries_dir / entry.key, doomed)  # gone for every reader at once
            except OSError:
                return False
        remove_folder(doomed)
        self.evicted.append(CacheEviction(key=entry.key, source=entry.source, bytes=entry.bytes, cause=cause,
                                          evicted_at=now))
        self.changed.set()
        log.info("cache.evicted", key=entry.key, source=entry.source, bytes=entry.bytes, cause=cause)
        return True
