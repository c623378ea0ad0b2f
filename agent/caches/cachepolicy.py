"""What a node's dataset cache keeps and when its disk is under pressure (SPEC D1, D2), as pure functions.

An entry is named by its dataset's folder and a fingerprint of its content (every file's path, size and
modification time), so a change in shared storage makes a new entry and never serves a stale copy. An
entry a job uses is pinned and never removed. Unpinned entries go, least recently used first:
- past the retention time since their last use;
- while the cache holds more than its high watermark of the disk, until it holds at most the low one;
- while the disk itself is fuller than its high threshold (disk pressure), until it is at most the low
  one; only what eviction cannot free makes the node unschedulable, and it takes work again only below
  the low threshold, so it does not flap at the line.

A copy never leaves its dataset (`links_refused`): a symbolic link in a dataset is copied as a link, and
every link must lead, followed as the kernel would in the copy, to a place inside the dataset's folder. An
absolute link, or a relative one climbing out of the folder (by itself, through other links or through a
linked folder), is refused, and so is a chain of links too long to follow (a loop).

Nothing here reads a disk or a clock: `now` and the sizes are parameters.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from libs.contracts.datacache import CachePolicy, EvictionCause

# Links followed at most in one path, below the kernel's 40: what the kernel could still follow is never let by.
MAX_LINK_HOPS = 32


@dataclass(frozen=True)
class SourceFile:
    """A file of a dataset folder in shared storage: its path inside the folder, size and modification time;
    for a symbolic link, its target as written (and its own size and time)."""

    path: str
    size: int
    mtime_ns: int
    link: str | None = None


def cache_key(source: str, files: Iterable[SourceFile]) -> str:
    """The entry a dataset folder `source`, holding `files`, is cached under (24 hex digits)."""
    digest = hashlib.sha256(source.encode())
    for file in sorted(files, key=lambda f: f.path):
        digest.update(f"\0{file.path}\0{file.size}\0{file.mtime_ns}".encode())
        if file.link is not None:  # datasets without links keep the keys they had
            digest.update(f"\0->{file.link}".encode())
    return digest.hexdigest()[:24]


def links_refused(files: Iterable[SourceFile], folder: str) -> list[tuple[str, str]]:
    """The links of a dataset listing (the folder's real path is `folder`) that do not stay inside it, each
    with why ("leads out of the dataset (to /…)"). Followed over the listing itself, never the disk: the copy
    is made of the listing, so this is where its links would lead a job."""
    links = {f.path: f.link for f in files if f.link is not None}
    refused = []
    for path in sorted(links):
        if (where := _leads_out(path, links, folder)) is not None:
            refused.append((path, f"leads out of the dataset (to {where})" if where else
                            f"loops, or goes through more than {MAX_LINK_HOPS} links"))
    return refused


def _leads_out(path: str, links: Mapping[str, str], folder: str) -> str | None:
    """Where the link at `path` leads if not inside the folder, following the links of `links` as the kernel
    does (a `..` goes up from where a link really led); "" for too many links; None when it stays inside. A
    missing step is taken by its name: a link that leads nowhere yet is judged by where it would lead."""
    here = path.split("/")[:-1]  # the folder the link is in: a path without links (listed as walked)
    pending = deque([links[path]])  # targets and components still to follow, first first
    hops = 1
    while pending:
        step = pending.popleft()
        if step.startswith("/"):
            return posixpath.normpath(posixpath.join(step, *pending))
        parts = [part for part in step.split("/") if part not in ("", ".")]
        if len(parts) > 1:
            pending.extendleft(reversed(parts))
            continue
        if not parts:
            continue
        if parts[0] == "..":
            if not here:
                return posixpath.normpath(posixpath.join(folder, "..", *pending))
            here.pop()
            continue
        target = links.get("/".join([*here, parts[0]]))
        if target is None:
            here.append(parts[0])
            continue
        hops += 1
        if hops > MAX_LINK_HOPS:
            return ""
        pending.appendleft(target)
    return None


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
