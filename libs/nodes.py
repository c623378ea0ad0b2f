"""Which nodes may take work, folded from the monitor's node events and the autoscaler's drains: the
scheduler places on them, and the autoscaler counts them before it asks for instances."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from libs.contracts.cluster import NodeInfo
from libs.contracts.events import (
    Event,
    InstanceDraining,
    InstanceKept,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeHealthy,
    NodeLost,
    NodeRecovered,
    NodeRegistered,
    NodeRetired,
    NodeUnhealthy,
)


@dataclass
class NodeState:
    info: NodeInfo
    lost: bool = False
    unhealthy: bool = False  # M2: a faulty component; unschedulable like a lost node
    problems: list[str] = field(default_factory=list)
    draining: bool = False  # A3: the autoscaler is about to release its instance
    disk_pressure: str | None = None  # D1: why its disk takes no new work

    @property
    def schedulable(self) -> bool:
        return not self.lost and not self.unhealthy and not self.draining and self.disk_pressure is None

    @property
    def status(self) -> Literal["ready", "lost", "unhealthy", "draining", "disk-full"]:
        return ("lost" if self.lost else "unhealthy" if self.unhealthy else "draining" if self.draining
                else "disk-full" if self.disk_pressure is not None else "ready")

    @property
    def reasons(self) -> list[str]:
        """Why it takes no work, as `trainyard nodes` shows it: its faults, and a disk under pressure."""
        return [*self.problems, *([self.disk_pressure] if self.disk_pressure else [])]


def fold_node_event(nodes: dict[str, NodeState], event: Event) -> bool:
    """Apply one of the monitor's node events, or the autoscaler's drains, to `nodes`; whether it was one."""
    if isinstance(event, NodeRegistered):
        # Health changes only by the monitor's NodeUnhealthy/NodeHealthy, not by registering again.
        known = nodes.get(event.node.name)
        nodes[event.node.name] = NodeState(info=event.node, unhealthy=known.unhealthy if known else False,
                                           problems=list(known.problems) if known else [],
                                           disk_pressure=known.disk_pressure if known else None)
        return True
    if isinstance(event, NodeDiskPressure | NodeDiskRelieved):
        if (node := nodes.get(event.node_name)) is not None:
            node.disk_pressure = event.reason if isinstance(event, NodeDiskPressure) else None
        return True
    if isinstance(event, NodeUnhealthy | NodeHealthy):
        if (node := nodes.get(event.node_name)) is not None:
            node.unhealthy = isinstance(event, NodeUnhealthy)
            node.problems = list(event.problems) if isinstance(event, NodeUnhealthy) else []
        return True
    if isinstance(event, NodeLost | NodeRecovered):
        if (node := nodes.get(event.node_name)) is not None:
            node.lost = isinstance(event, NodeLost)
        return True
    if isinstance(event, NodeRetired):
        nodes.pop(event.node_name, None)
        return True
    if isinstance(event, InstanceDraining | InstanceKept):
        if (node := nodes.get(event.node)) is not None:
            node.draining = isinstance(event, InstanceDraining)
        return True
    return False
