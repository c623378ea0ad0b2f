"""`trainyard cache` (SPEC D1, D2): each node's dataset cache, as its agent last reported it.

Reports come whole, so the latest one per node is the view; a node retired since is left out.
"""

from __future__ import annotations

from collections.abc import Mapping

from libs.contracts.datacache import CacheReport
from libs.contracts.messages import CacheListing, NodeCache
from services.monitor.state import MonitoredNode


def listing(reports: Mapping[str, CacheReport], nodes: Mapping[str, MonitoredNode],
            node: str | None = None) -> CacheListing:
    shown = [report for name, report in sorted(reports.items()) if name in nodes and node in (None, name)]
    return CacheListing(nodes=[NodeCache(node=r.node, reported_at=r.sent_at, entries=list(r.entries),
                                         disk_bytes=r.disk_bytes, used_bytes=r.used_bytes) for r in shown])
