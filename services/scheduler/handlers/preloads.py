"""`trainyard cache preload` (SPEC D2): a dataset copied into chosen nodes' caches ahead of its jobs.

The scheduler checks the request as it checks a job's storage (the dataset exists, the caller may read
it), resolves the nodes (named, or every schedulable node a rank of a flavor fits on), and records
`DatasetPreloadRequested`; the monitor, following the scheduler's events, asks each node's agent to copy
it. A repeated request (the same `preload_id`) gets the same answer and records nothing.
"""

from __future__ import annotations

from pathlib import Path

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.events import DatasetPreloadRequested
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.cache import PRELOAD_DATASET, PreloadAccepted, PreloadDataset
from libs.eventstore import NewEvent
from libs.messaging.responder import Route
from services.scheduler.domain.storage_access import own_access
from services.scheduler.interfaces import Scheduling

PRELOAD = "preload"  # the scheduler's aggregate of a preload (id = its preload_id)


def could_hold(info: NodeInfo, flavor: Flavor) -> bool:
    """A rank of `flavor` fits on the node when it is empty, boards included."""
    boards = flavor.accelerators == 0 or any(group.board == flavor.board and group.count >= flavor.accelerators
                                             for group in info.accelerators)
    return boards and Resources.of_flavor(flavor).fits_in(Resources.of_node(info))


class PreloadCommands:
    def __init__(self, scheduler: Scheduling, *, storage_root: Path) -> None:
        self.scheduler = scheduler
        self.storage_root = storage_root

    def routes(self) -> list[Route]:
        return [(PRELOAD_DATASET, self.preload)]

    async def preload(self, request: PreloadDataset, identity: Identity) -> PreloadAccepted | CommandError:
        state = self.scheduler.state
        source = f"datasets/{request.name}" + (f"/{request.version}" if request.version else "")
        if (done := state.preloads.get(request.preload_id)) is not None:
            return PreloadAccepted(preload_id=done.preload_id, source=done.source, nodes=list(done.nodes))
        if not (self.storage_root / source).is_dir():
            return CommandError(code="not-found", message=f"{source} does not exist in shared storage",
                                hint="check the dataset's name and version; nothing was preloaded")
        entry = state.storage.get(("dataset", request.name))
        if own_access(entry, identity, sharing_enabled=state.settings.sharing_enabled) == "none":
            return CommandError(code="forbidden", message=f"you have no access to dataset {request.name!r}",
                                hint="ask its owner to share it with your project")
        nodes = self._nodes(request)
        if isinstance(nodes, CommandError):
            return nodes
        async with self.scheduler.lock:
            await self.scheduler.record([NewEvent(PRELOAD, request.preload_id, DatasetPreloadRequested(
                preload_id=request.preload_id, source=source, nodes=nodes, by=identity.user))])
        return PreloadAccepted(preload_id=request.preload_id, source=source, nodes=nodes)

    def _nodes(self, request: PreloadDataset) -> list[str] | CommandError:
        state = self.scheduler.state
        if bool(request.nodes) == (request.flavor is not None):
            return CommandError(code="invalid-request", message="name the nodes or a flavor, not both nor neither",
                                hint="--node NODE (repeatable) or --flavor FLAVOR")
        if request.nodes:
            unknown = [name for name in request.nodes if name not in state.nodes]
            if unknown:
                return CommandError(code="not-found", message=f"no such node: {', '.join(unknown)}",
                                    hint="`trainyard nodes` lists the nodes")
            return list(dict.fromkeys(request.nodes))
        flavor = state.flavor(request.flavor or "")
        if flavor is None:
            return CommandError(code="not-found", message=f"no such flavor: {request.flavor}",
                                hint="`trainyard flavors` lists them")
        nodes = [name for name, node in sorted(state.nodes.items())
                 if node.schedulable and could_hold(node.info, flavor)]
        if not nodes:
            return CommandError(code="not-found", message=f"no node that takes work can hold a rank of "
                                f"{flavor.name}", hint="`trainyard nodes` shows which nodes take work")
        return nodes
