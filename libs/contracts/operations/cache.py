"""Nodes' dataset caches: what they hold and preloading a dataset into them (SPEC D1, D2); and the images the
nodes keep unpacked (J10).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from libs.contracts.datacache import CachedImage, CacheEntry, CopyUnderWay, StagingFailed
from libs.contracts.jobspec import NodeName, ResourceName
from libs.contracts.operations.base import ReplyMessage, RequestMessage, people_operation

PRELOAD_ID = r"^preload-[0-9a-f]{12}\Z"


class PreloadDataset(RequestMessage, frozen=True, tag="PreloadDataset.v1"):
    """D2: copy dataset `name` (at `version`) into the caches of `nodes`, or of every node that can take a
    rank of `flavor`, ahead of the jobs that read it. `preload_id` (chosen by the client) makes a repeated
    request the same preload."""

    preload_id: Annotated[str, Meta(pattern=PRELOAD_ID)]
    name: ResourceName
    version: ResourceName | None = None
    nodes: Annotated[list[NodeName], Meta(max_length=1000)] = msgspec.field(default_factory=list)
    flavor: ResourceName | None = None


class PreloadAccepted(ReplyMessage, frozen=True, tag="PreloadAccepted.v1"):
    """The preload is recorded: each of `nodes` is asked to copy `source`; `trainyard cache` shows it."""

    preload_id: str
    source: str
    nodes: list[str]


class ListCache(RequestMessage, frozen=True, tag="ListCache.v1"):
    """D1, D2, J10: the dataset and image caches of every node, or of `node`."""

    node: str | None = None


class NodeCache(Struct, frozen=True, kw_only=True):
    """One node's caches as its agent last reported them: the dataset cache's entries, the copies under way and
    the preloads that failed lately; and the images it keeps unpacked. `complete` false: the node holds more
    entries than a report carries (`total_entries`, None when its agent does not say), and `entries` are its
    most recently used ones."""

    node: str
    reported_at: datetime
    entries: list[CacheEntry]
    disk_bytes: int = 0
    used_bytes: int = 0
    copying: list[CopyUnderWay] = msgspec.field(default_factory=list)
    failures: list[StagingFailed] = msgspec.field(default_factory=list)
    complete: bool = True
    total_entries: int | None = None
    images: list[CachedImage] = msgspec.field(default_factory=list)


class CacheListing(ReplyMessage, frozen=True, tag="CacheListing.v1"):
    nodes: list[NodeCache]


# --- operations ------------------------------------------------------------------------------------

LIST_CACHE = people_operation(
    "list-cache", "trainyard.query.cache", ListCache, CacheListing, "monitor", changes_state=False,
    summary="The dataset and image caches of the nodes.")
PRELOAD_DATASET = people_operation(
    "preload-dataset", "trainyard.cmd.cache.preload", PreloadDataset, PreloadAccepted, "scheduler", changes_state=True,
    summary="Copy a dataset into nodes' caches ahead of the jobs that read it.")
