"""Metrics: the OpenTelemetry instruments every process records, served to Prometheus and pushed over OTLP.

A process exports its metrics when told how (`configure_metrics`, called by `libs.skeleton.entrypoint`):

- `TRAINYARD_METRICS_PORT=N` serves them in Prometheus' text format at `http://ADDRESS:N/metrics`, ADDRESS being
  `TRAINYARD_METRICS_ADDRESS` (default 127.0.0.1; a pod sets 0.0.0.0). `0` takes a free port. With
  `TRAINYARD_METRICS_TARGETS=DIR` the process also writes where it serves into `DIR/<process>-<pid>.json`, in
  Prometheus' file service discovery format, so a Prometheus finds every process of a stack however many run.
- `TRAINYARD_METRICS=otlp` pushes them every 15 s over OTLP/HTTP (endpoint from the standard `OTEL_EXPORTER_OTLP_*`).

Otherwise nothing is exported and the instruments are OpenTelemetry's no-ops: nothing is recorded or paid.

Every metric is declared once, in `CATALOGUE` (name, kind, unit, attributes, who records it); docs/operations.md
lists them all. Names and attributes follow OpenTelemetry's semantic conventions (`messaging.process.duration` for
requests, `{unit}` annotations, dotted lowercase names; Prometheus sees `trainyard_jobs_queued`,
`messaging_process_duration_seconds`...). No attribute takes unbounded values: no job ids, no user names.

Gauges of a service's state are sampled on its event loop (`SampledGauge.set`, every `SAMPLE_SECONDS`): a scrape,
which runs in the exporter's thread, reads the last sample and never walks a state the loop is changing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import metrics as otel_metrics

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

SAMPLE_SECONDS = 5.0
METER = "trainyard"
# Seconds, from a millisecond to a minute: requests, cycles and predictions all fall within (OpenTelemetry's
# advice for `messaging.process.duration`, stretched to a minute for a cold plan).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    30.0, 60.0)

Kind = Literal["counter", "histogram", "gauge"]


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    unit: str
    description: str
    attributes: tuple[str, ...] = ()
    recorded_by: str = "every service"

    @property
    def prometheus_name(self) -> str:
        """The name Prometheus shows (the OpenTelemetry exporter's translation)."""
        base = self.name.replace(".", "_")
        suffix = {"s": "_seconds", "By": "_bytes"}.get(self.unit, "")
        return base + suffix + ("_total" if self.kind == "counter" else "")


# A request's subject, or the stream a follower reads; and the follower's consumer.
DESTINATION, CONSUMER = "messaging.destination.name", "messaging.consumer.group.name"

# Every process.
REQUEST_DURATION = Metric(
    "messaging.process.duration", "histogram", "s",
    "How long a request took to answer, by subject; `error.type` is the error's code when it was refused",
    ("messaging.system", DESTINATION, "error.type"), "every service and agent")
REPLIES_REFUSED = Metric(
    "trainyard.requests.reply_refused", "counter", "{request}",
    "Requests neither answered nor carried out because their reply subject is not the caller's own inbox, by "
    "subject", (DESTINATION,), "every service and agent")
# Every service.
ACTIVE = Metric("trainyard.service.active", "gauge", "1",
                "1 when this process is the service's active instance, 0 while it stands by")
EVENTS_RECORDED = Metric("trainyard.events.recorded", "counter", "{event}",
                         "Events the service appended to its log, by type", ("trainyard.event.type",))
OUTBOX_LAG = Metric("trainyard.outbox.lag", "gauge", "{event}",
                    "Events stored in the service's log but not yet published to JetStream")
FOLLOWER_LAG = Metric("trainyard.follower.lag", "gauge", "{message}",
                      "Messages of a followed stream not yet handled, by stream and consumer", (DESTINATION, CONSUMER))
FOLLOWER_MESSAGES = Metric("trainyard.follower.messages", "counter", "{message}",
                           "Messages of a followed stream handled, by stream and consumer", (DESTINATION, CONSUMER))
# The scheduler.
JOBS_QUEUED = Metric("trainyard.jobs.queued", "gauge", "{job}",
                     "Jobs waiting in the queue, by priority and the first flavor they ask for",
                     ("trainyard.priority", "trainyard.flavor"), "scheduler")
JOBS = Metric("trainyard.jobs", "gauge", "{job}", "Jobs by state (queued, running, succeeded, failed, stopped, "
              "expired), deleted ones included", ("trainyard.job.state",), "scheduler")
ADMISSIONS = Metric("trainyard.scheduler.admissions", "counter", "{job}", "Jobs admitted (placed on nodes), by "
                    "priority", ("trainyard.priority",), "scheduler")
CYCLE_DURATION = Metric("trainyard.scheduler.cycle.duration", "histogram", "s",
                        "How long a scheduling cycle took to decide (its count is the cycles run)", (), "scheduler")
PREDICTION_DURATION = Metric("trainyard.scheduler.prediction.duration", "histogram", "s",
                             "How long a plan of the queue took (the predictions of new jobs, `predict`, `why`)",
                             (), "scheduler")
RESUMES = Metric("trainyard.jobs.resumes", "counter", "{job}",
                 "Checkpoint-resume jobs moved off a lost, unhealthy or slow node", (), "scheduler")
RESTARTS = Metric("trainyard.jobs.restarts", "counter", "{job}", "Fault-restart jobs started again after a "
                  "failure", (), "scheduler")
# The monitor.
NODES = Metric("trainyard.nodes", "gauge", "{node}", "Registered nodes by state (up, lost) and health "
               "(healthy, unhealthy)", ("trainyard.node.state", "trainyard.node.health"), "monitor")
ALERTS = Metric("trainyard.alerts", "counter", "{alert}", "Alerts raised, by kind", ("trainyard.alert.kind",),
                "monitor")
# The autoscaler.
INSTANCES = Metric("trainyard.autoscaler.instances", "gauge", "{instance}",
                   "The autoscaler's instances not ended, by type and state (requested, booting, ready, draining)",
                   ("trainyard.instance.type", "trainyard.instance.state"), "autoscaler")
# The node agents.
AGENT_PROCESSES = Metric("trainyard.agent.processes", "gauge", "{process}",
                         "Job processes (ranks) the agent runs now", (), "node agent")
CACHE_REQUESTS = Metric("trainyard.dataset_cache.requests", "counter", "{request}",
                        "Datasets a job's node asked of the node's cache, by result (hit, miss)",
                        ("trainyard.cache.result",), "node agent")
CACHE_SIZE = Metric("trainyard.dataset_cache.size", "gauge", "By", "Bytes the node's dataset cache holds", (),
                    "node agent")

# The gateway.
HTTP_DURATION = Metric("http.server.request.duration", "histogram", "s",
                       "How long an HTTP request took to answer (a follow stream or terminal: how long it was open), "
                       "by method, route template and status", ("http.request.method", "http.route",
                                                                "http.response.status_code"), "gateway")
GATEWAY_OPEN = Metric("trainyard.gateway.open", "gauge", "{connection}",
                      "What the gateway holds open: console sessions, follow streams, terminals, users' NATS "
                      "connections", ("trainyard.gateway.kind",), "gateway")

CATALOGUE: tuple[Metric, ...] = (
    REQUEST_DURATION, REPLIES_REFUSED, ACTIVE, EVENTS_RECORDED, OUTBOX_LAG, FOLLOWER_LAG, FOLLOWER_MESSAGES,
    JOBS_QUEUED, JOBS, ADMISSIONS, CYCLE_DURATION, PREDICTION_DURATION, RESUMES, RESTARTS, NODES, ALERTS, INSTANCES,
    AGENT_PROCESSES, CACHE_REQUESTS, CACHE_SIZE, HTTP_DURATION, GATEWAY_OPEN)


# --- set-up -------------------------------------------------------------------------------------------------

_enabled = False
_serving: tuple[Any, Path | None] | None = None  # the HTTP server and the target file it wrote


def metrics_enabled() -> bool:
    """Whether this process exports metrics (sampling loops run only then)."""
    return _enabled


def configure_metrics(process: str, *, service: str | None = None, node: str | None = None) -> None:
    """Export this process's metrics as the environment says (module docstring); `process` names its target file,
    `service` and `node` label it."""
    global _enabled, _serving
    port = os.environ.get("TRAINYARD_METRICS_PORT", "").strip()
    push = os.environ.get("TRAINYARD_METRICS", "").strip().lower() == "otlp"
    if _enabled or (not port and not push):
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource

    readers: list[MetricReader] = []
    if port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers.append(PrometheusMetricReader())
    if push:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=15_000))
    attributes = {"service.name": f"trainyard-{service or process}"}
    otel_metrics.set_meter_provider(MeterProvider(resource=Resource.create(attributes), metric_readers=readers))
    _enabled = True
    if port:
        _serving = _serve(process, int(port), service=service or process, node=node)


def _serve(process: str, port: int, *, service: str, node: str | None) -> tuple[Any, Path | None]:
    from prometheus_client import start_http_server

    address = os.environ.get("TRAINYARD_METRICS_ADDRESS", "127.0.0.1")
    server, _ = start_http_server(port, addr=address)
    bound = server.server_port
    target: Path | None = None
    if folder := os.environ.get("TRAINYARD_METRICS_TARGETS"):
        host = socket.gethostname() if address == "0.0.0.0" else address
        labels = {"service": service, **({"node": node} if node else {})}
        target = Path(folder) / f"{process}-{os.getpid()}.json"  # a standby beside the active one too
        target.parent.mkdir(parents=True, exist_ok=True)
        written = target.with_suffix(".tmp")
        written.write_text(json.dumps([{"targets": [f"{host}:{bound}"], "labels": labels}]))
        written.replace(target)  # Prometheus never reads half a file
    return server, target


def served_port() -> int | None:
    """The port this process serves its metrics on (None: not served)."""
    return int(_serving[0].server_port) if _serving is not None else None


def shutdown_metrics() -> None:
    """Stop serving and forget the target file, so that Prometheus stops looking for this process."""
    global _serving
    if _serving is not None:
        server, target = _serving
        _serving = None
        with contextlib.suppress(Exception):
            server.shutdown()
        if target is not None:
            target.unlink(missing_ok=True)
    provider = otel_metrics.get_meter_provider()
    with contextlib.suppress(Exception):
        provider.shutdown()  # type: ignore[attr-defined]  # the SDK's pushes what it still holds


# --- instruments --------------------------------------------------------------------------------------------

def _meter() -> otel_metrics.Meter:
    return otel_metrics.get_meter(METER)


def counter(metric: Metric) -> Counter:
    assert metric.kind == "counter", metric
    return _meter().create_counter(metric.name, unit=metric.unit, description=metric.description)


def histogram(metric: Metric) -> Histogram:
    assert metric.kind == "histogram", metric
    return _meter().create_histogram(metric.name, unit=metric.unit, description=metric.description,
                                     explicit_bucket_boundaries_advisory=DURATION_BUCKETS)


class SampledGauge:
    """A gauge whose values the process sets on its own loop (`set`), read by whatever collects them."""

    def __init__(self, metric: Metric) -> None:
        assert metric.kind == "gauge", metric
        self.metric = metric
        self._values: Mapping[tuple[str, ...], float] = {}
        _meter().create_observable_gauge(metric.name, callbacks=[self._observe], unit=metric.unit,
                                         description=metric.description)

    def set(self, values: Mapping[tuple[str, ...], float] | float) -> None:
        """Replace every value: by the attributes' values, in the order the metric names them (a number alone for
        a metric without attributes). A combination left out is no longer reported."""
        self._values = {(): float(values)} if isinstance(values, int | float) else dict(values)

    def _observe(self, _: CallbackOptions) -> Iterable[Observation]:
        from opentelemetry.metrics import Observation

        names = self.metric.attributes
        for key, value in self._values.items():  # the mapping is replaced whole, never changed in place
            yield Observation(value, dict(zip(names, key, strict=True)))


def attributes(metric: Metric, *values: str) -> dict[str, str]:
    """The attributes of one recording of `metric`, in the order it names them."""
    return dict(zip(metric.attributes, values, strict=True))
