"""How a preload (SPEC D2) is getting on, node by node, read from the nodes' cache reports.

A node is done once its cache holds the dataset used since the preload began (a copy made, or one there
already that the preload touched), failed once it reports a failure for it since then, and copying while
a copy of it is under way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from libs.contracts.operations.cache import NodeCache

PreloadState = Literal["waiting", "copying", "done", "failed"]


@dataclass(frozen=True)
class NodePreload:
    node: str
    state: PreloadState
    done_bytes: int = 0
    total_bytes: int = 0
    reason: str = ""

    @property
    def settled(self) -> bool:
        return self.state in ("done", "failed")


def preload_states(caches: Iterable[NodeCache], nodes: Sequence[str], source: str,
                   since: datetime) -> list[NodePreload]:
    """Each of `nodes`, as its latest cache report shows the preload of `source` begun at `since`."""
    reports = {cache.node: cache for cache in caches}
    states = []
    for node in nodes:
        report = reports.get(node)
        if report is None:
            states.append(NodePreload(node, "waiting"))
            continue
        held = [e for e in report.entries if e.source == source and e.last_used >= since]
        failed = [f for f in report.failures if f.source == source and f.failed_at >= since]
        copying = [c for c in report.copying if c.source == source]
        if held:
            states.append(NodePreload(node, "done", held[0].bytes, held[0].bytes))
        elif copying:
            states.append(NodePreload(node, "copying", copying[0].done_bytes, copying[0].total_bytes))
        elif failed:
            states.append(NodePreload(node, "failed", reason=failed[-1].reason))
        else:
            states.append(NodePreload(node, "waiting"))
    return states
