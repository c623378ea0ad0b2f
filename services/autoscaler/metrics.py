"""The autoscaler's metrics (libs/telemetry/metrics.py): its instances not ended, by type and state, as the state
counts them while it folds (never a walk over its instances or jobs)."""

from __future__ import annotations

from libs.telemetry.metrics import INSTANCES, SampledGauge
from services.autoscaler.state import AutoscalerState

_instances = SampledGauge(INSTANCES)
STATES = ("requested", "booting", "ready", "draining")


def sample(state: AutoscalerState, instance_types: list[str]) -> None:
    """Every configured type in every state, zeros included, so that a chart shows a type's instances ending."""
    counts = state.instance_counts
    types = sorted(set(instance_types) | {kind for kind, _ in counts})
    _instances.set({(kind, st): counts.get((kind, st), 0) for kind in types for st in STATES})
