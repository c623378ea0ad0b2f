"""The monitor's state: registered nodes, their health, and when each was last heard from."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.cluster import NodeInfo
from libs.contracts.events import EventEnvelope, NodeLost, NodeRecovered, NodeRegistered


@dataclass
class MonitoredNode:
    info: NodeInfo
    version: int
    lost: bool = False
    last_seen: float = 0.0  # monotonic seconds; not part of the event log


@dataclass
class MonitorState:
    nodes: dict[str, MonitoredNode] = field(default_factory=dict)

    def apply(self, envelope: EventEnvelope, now: float) -> None:
        event = envelope.event
        if isinstance(event, NodeRegistered):
            previous = self.nodes.get(event.node.name)
            self.nodes[event.node.name] = MonitoredNode(
                info=event.node, version=envelope.version, last_seen=previous.last_seen if previous else now
            )
            return
        node = self.nodes.get(envelope.aggregate_id)
        if node is None:
            return
        node.version = envelope.version
        if isinstance(event, NodeLost):
            node.lost = True
        elif isinstance(event, NodeRecovered):
            node.lost = False
            node.last_seen = now

    def overdue(self, now: float, lost_after: float) -> list[MonitoredNode]:
        """Nodes, not yet marked lost, whose last heartbeat is older than `lost_after` seconds."""
        return [n for n in self.nodes.values() if not n.lost and now - n.last_seen > lost_after]


def lost_event(node: MonitoredNode, now: float, wall_now: datetime) -> NodeLost:
    silent = now - node.last_seen
    return NodeLost(node_name=node.info.name, last_seen=wall_now - timedelta(seconds=silent),
                    reason=f"no heartbeat for {silent:.0f}s")
