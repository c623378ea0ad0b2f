"""The monitor's metrics (libs/telemetry/metrics.py): its nodes by state and health, sampled from the state, and
the alerts it raises, counted as they are recorded."""

from __future__ import annotations

from collections import Counter

from libs.contracts.events import AlertRaised, EventEnvelope
from libs.telemetry.metrics import ALERTS, NODES, SampledGauge, counter
from services.monitor.state import MonitorState

_nodes = SampledGauge(NODES)
_alerts = counter(ALERTS)


def sample(state: MonitorState) -> None:
    """Every registered node counted once: up or lost, healthy or not (a probe's problem or a faulty mark)."""
    counts: Counter[tuple[str, ...]] = Counter()
    for node in state.nodes.values():
        counts[("lost" if node.lost else "up", "unhealthy" if node.problems or node.marks else "healthy")] += 1
    _nodes.set({(st, health): counts.get((st, health), 0)
                for st in ("up", "lost") for health in ("healthy", "unhealthy")})


def count(envelope: EventEnvelope) -> None:
    if isinstance(envelope.event, AlertRaised):
        _alerts.add(1, {"trainyard.alert.kind": envelope.event.kind})
