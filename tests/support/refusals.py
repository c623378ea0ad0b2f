"""Refusals in tests: what `trainyard.requests.reply_refused` counts (the instruments recorded on a meter of the
test's own, read back from memory: no exporter, nothing global), and values a field refuses (`wrong_type`)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from libs.telemetry import metrics
from tests.support.waiting import eventually


class Refusals:
    """The requests refused for their reply subject, by subject (an agent's as its template)."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])

    def count(self, destination: str) -> int:
        data = self.reader.get_metrics_data()
        found = 0
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != metrics.REPLIES_REFUSED.name:
                        continue
                    for point in metric.data.data_points:
                        if isinstance(point, NumberDataPoint) and (point.attributes or {}).get(
                                metrics.DESTINATION) == destination:
                            found += int(point.value)
        return found

    async def counted(self, destination: str, expected: int, wait: float = 30) -> None:
        """Return once `expected` refusals on `destination` were counted, and no more."""
        async def reached() -> bool:
            return self.count(destination) >= expected

        await eventually(reached, wait)
        assert self.count(destination) == expected


def count_refusals(monkeypatch: pytest.MonkeyPatch) -> Refusals:
    """From now on until the test ends, every instrument is made on the returned meter (`libs.telemetry.metrics`
    looks its meter up each time it makes one)."""
    found = Refusals()
    monkeypatch.setattr(metrics, "_meter", lambda: found.provider.get_meter(metrics.METER))
    return found


def wrong_type(value: Any) -> Any:
    """A value of another JSON type than `value`, which its field cannot take."""
    if isinstance(value, bool) or value is None:
        return [[{}]]
    if isinstance(value, str):
        return 12345
    if isinstance(value, int | float):
        return "many"
    if isinstance(value, list):
        return "not a list"
    return [1]  # an object
