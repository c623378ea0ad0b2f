"""What a node's dataset cache keeps and when its disk is under pressure (SPEC D1, D2), as pure functions.

An entry is named by its dataset's folder and a fingerprint of its content (every file's path, size and
modification time), so a change in shared storage makes a new entry and never serves a stale copy. An
entry a job uses is pinned and never removed. Unpinned entries go, least recently used first:
- past the retention time since their last use;
- while the cache holds more than its high watermark of the disk, until it holds at most the low one;
- while the disk itself is fuller than its high threshold (disk pressure), until it is at most the low
  one; only what eviction cannot free makes the node unschedulable, and it takes work again only below
  the low threshold, so it does not flap at the line.

Nothing here reads a disk or a clock: `now` and the sizes are parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from libs.contracts.datacache import CachePolicy, EvictionCause


@dataclass(frozen=True)
class SourceFile:
    """A file of a dataset folder in shared storage: its path inside the folder, size and modification time."""

    path: str
    size: int
    mtime_ns: int


def cache_key(source: str, files: Iterable[SourceFile]) -> str:
    """The entry a dataset folder `source`, holding `files`, is cached under (24 hex digits)."""
    digest = hashlib.sha256(source.encode())
    for file in sorted(files, key=lambda f: f.path):
        digest.update(f"\0{file.path}\0{file.size}\0{file.mtime_ns}".encode())
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class Held:
    """An entry as the policy sees it."""

    key: str
    bytes: int
    last_used: datetime
    pinned: bool


def evictions(entries: Sequence[Held], policy: CachePolicy, *, disk_bytes: int, disk_used_bytes: int,
              now: datetime) -> list[tuple[str, EvictionCause]]:
    """The entries to remove now, and why: retention first, then the cache's watermark, then the disk's
    pressure; pinned entries never."""
    retention = timedelta(seconds=policy.retention_seconds)
    chosen: list[tuple[str, EvictionCause]] = [(e.key, "retention") for e in entries
                                               if not e.pinned and now - e.last_used > retention]
    gone = {key for key, _ in chosen}
    candidates = sorted((e for e in entries if not e.pinned and e.key not in gone), key=lambda e: e.last_used)
    cached = sum(e.bytes for e in entries if e.key not in gone)
    used = disk_used_bytes - sum(e.bytes for e in entries if e.key in gone)
    if disk_bytes > 0 and cached > disk_bytes * policy.high_percent / 100:
        while candidates and cached > disk_bytes * policy.low_percent / 100:
            entry = candidates.pop(0)
            chosen.append((entry.key, "watermark"))
            cached, used = cached - entry.bytes, used - entry.bytes
    if disk_bytes > 0 and used > disk_bytes * policy.disk_high_percent / 100:
        while candidates and used > disk_bytes * policy.disk_low_percent / 100:
            entry = candidates.pop(0)
            chosen.append((entry.key, "disk-pressure"))
            used -= entry.bytes
    return chosen


def under_pressure(disk_used_bytes: int, disk_bytes: int, policy: CachePolicy, *, was: bool) -> bool:
    """Whether the disk is under pressure now: above the high threshold it is; one that was stays so until it
    is at or below the low threshold (hysteresis)."""
    if disk_bytes <= 0:
        return False
    percent = 100 * disk_used_bytes / disk_bytes
    return percent > (policy.disk_low_percent if was else policy.disk_high_percent)
