"""A node's dataset cache (SPEC J14, D1, D2): the copies data preparation makes on a node's local disk.

A job with `data_preparation` has each of its nodes copy its read-only datasets (and annotation datasets)
from shared storage into the node's cache before its command starts, and reads them there. An entry is
one dataset folder as it was when copied: its key names the folder and a fingerprint of its content (every
file's path, size and modification time), so a change in shared storage is a new entry. The agent owns its
cache (it lives on its disk) and reports it to the monitor, which records what was cached and evicted as
events and answers `trainyard cache`. The same report lists the images the node keeps unpacked (J10,
agent/caches/imagecache.py), for `trainyard cache` and the console only: no event records them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.images import Digest, ImageFormat

MAX_CACHE_ENTRIES_REPORTED = 5_000  # a report stays well under NATS's payload limit
MAX_IMAGES_REPORTED = 100  # unpacked images take gigabytes each: a node's disk holds far fewer
CACHE_KEY_PATTERN = r"^[0-9a-f]{24}\Z"
CacheKey = Annotated[str, Meta(pattern=CACHE_KEY_PATTERN)]
EvictionCause = Literal["retention", "watermark", "disk-pressure", "unreadable"]


class CachePolicy(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How nodes keep their caches (administrator settings, handed to each agent as it registers).

    An entry no job pins is removed `retention_seconds` after its last use; when the cache holds more than
    `high_percent` of its disk, the least recently used unpinned entries are removed until it holds at most
    `low_percent`. A disk fuller than `disk_high_percent` (whatever fills it) has unpinned entries evicted
    down to `disk_low_percent`; if that is not enough the node takes no new work until the disk is at or
    below `disk_low_percent` again."""

    retention_seconds: Annotated[float, Meta(gt=0)] = 7 * 86400.0
    high_percent: Annotated[float, Meta(gt=0, le=100)] = 50.0
    low_percent: Annotated[float, Meta(ge=0, le=100)] = 40.0
    disk_high_percent: Annotated[float, Meta(gt=0, le=100)] = 90.0
    disk_low_percent: Annotated[float, Meta(ge=0, le=100)] = 85.0


class StagedDataset(Struct, frozen=True, kw_only=True):
    """One dataset a node of a job read from its cache: `hit` when the copy was there already (or being made
    for another job), else copied for this one in `seconds`."""

    source: str  # its folder in shared storage, e.g. datasets/imgs/v1
    key: CacheKey
    bytes: Annotated[int, Meta(ge=0)]
    files: Annotated[int, Meta(ge=0)]
    hit: bool
    seconds: Annotated[float, Meta(ge=0)] = 0.0


class CacheEntry(Struct, frozen=True, kw_only=True):
    """One entry of a node's cache, as its agent reports it."""

    key: CacheKey
    source: str
    bytes: Annotated[int, Meta(ge=0)]
    files: Annotated[int, Meta(ge=0)]
    staged_at: datetime
    last_used: datetime
    pins: list[str] = msgspec.field(default_factory=list)  # who uses it now: <job>/<attempt>/<task>/<rank>


class CachedImage(Struct, frozen=True, kw_only=True):
    """One image unpacked in a node's image cache (J10), as its agent reports it: `ref` is the reference the job
    that had it unpacked named it by ("" when the agent that unpacked it did not keep it); `bytes` what its root
    filesystem takes on the node's disk."""

    key: CacheKey  # the first 24 hex digits of its archive's digest
    digest: Digest
    ref: Annotated[str, Meta(max_length=300)] = ""
    format: ImageFormat
    bytes: Annotated[int, Meta(ge=0)]
    unpacked_at: datetime
    last_used: datetime
    pins: list[str] = msgspec.field(default_factory=list)  # who uses it now: <job>/<attempt>/<task>/<rank>


class CacheEviction(Struct, frozen=True, kw_only=True):
    key: CacheKey
    source: str
    bytes: Annotated[int, Meta(ge=0)]
    cause: EvictionCause
    evicted_at: datetime


class CopyUnderWay(Struct, frozen=True, kw_only=True):
    """A copy being made into the cache: how far it is."""

    source: str
    key: CacheKey
    done_bytes: Annotated[int, Meta(ge=0)]
    total_bytes: Annotated[int, Meta(ge=0)]
    started_at: datetime


class StagingFailed(Struct, frozen=True, kw_only=True):
    """A copy that could not be made (a preload's: a job's failure is told in its own log)."""

    source: str
    reason: Annotated[str, Meta(max_length=1000)]
    failed_at: datetime


class CacheReport(Struct, frozen=True, kw_only=True, tag_field="type", tag="CacheReport.v1"):
    """A node's whole cache now, and what it evicted since its last report (published on `agent_cache(node)`
    whenever it, or the image cache, changes). `disk_bytes`: the size of the disk it lives on; `used_bytes`: what
    is used there in all.

    A cache of more than MAX_CACHE_ENTRIES_REPORTED entries is cut short: `entries` are its most recently used
    ones and `total_entries` says how many it holds; what a cut-short report leaves out is not evicted (see
    `complete`). `images`: the node's image cache, its MAX_IMAGES_REPORTED most recently used images at most.
    The fields after `failures` came later: an older agent's report decodes without them."""

    node: str
    sent_at: datetime
    entries: Annotated[list[CacheEntry], Meta(max_length=MAX_CACHE_ENTRIES_REPORTED)]
    evicted: Annotated[list[CacheEviction], Meta(max_length=MAX_CACHE_ENTRIES_REPORTED)] = msgspec.field(
        default_factory=list)
    disk_bytes: Annotated[int, Meta(ge=0)] = 0
    used_bytes: Annotated[int, Meta(ge=0)] = 0
    copying: Annotated[list[CopyUnderWay], Meta(max_length=MAX_CACHE_ENTRIES_REPORTED)] = msgspec.field(
        default_factory=list)
    failures: Annotated[list[StagingFailed], Meta(max_length=100)] = msgspec.field(default_factory=list)
    total_entries: Annotated[int, Meta(ge=0)] | None = None  # None: an older agent's report, which does not say
    images: Annotated[list[CachedImage], Meta(max_length=MAX_IMAGES_REPORTED)] = msgspec.field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether `entries` are every entry of the cache, so that one missing from them is gone. An older
        agent's report (without `total_entries`) that fills the bound may have been cut there: it is not."""
        if self.total_entries is None:
            return len(self.entries) < MAX_CACHE_ENTRIES_REPORTED
        return self.total_entries <= len(self.entries)


STAGE_SOURCE = r"^(datasets|annotations)/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,127})?\Z"
