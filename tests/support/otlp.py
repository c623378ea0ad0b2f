"""A real OTLP/HTTP receiver for tests: what a collector (Jaeger, Tempo) is sent, decoded and kept.

It serves `POST /v1/traces` and `/v1/metrics` on a free port of 127.0.0.1, in a thread of its own, and takes what
OpenTelemetry's OTLP/HTTP exporters send: an `ExportTraceServiceRequest` or `ExportMetricsServiceRequest` in protobuf
(`Content-Type: application/x-protobuf`, gzip-compressed or not). Every span is kept, flattened with the name of the
service that sent it, and the name of every metric; each export is answered 200 with an empty response, as a
collector answers one it took whole.

    with OtlpReceiver() as receiver:
        env = {"TRAINYARD_TRACES": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
        ...
        spans = receiver.trace(trace_id)
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus

PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as a collector got it: ids in lower-case hex (`parent_span_id` empty for a root)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str  # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER (UNSPECIFIED when the sender said none)
    service: str  # service.name of the sender's resource
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "UNSET"  # UNSET, OK, ERROR
    start_ns: int = 0
    end_ns: int = 0

    @property
    def is_root(self) -> bool:
        return not self.parent_span_id


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python's: str, bool, int, float, bytes, list or dict (None when unset)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which)


def attributes_of(pairs: Any) -> dict[str, Any]:
    """Repeated `KeyValue`s as a dict."""
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = value_of(pair.value)
    return found


def spans_of(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one export, with the service.name of the resource that sent it."""
    spans = []
    for resource_spans in request.resource_spans:
        service = str(attributes_of(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                    name=span.name, kind=ProtoSpan.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                    service=service, attributes=attributes_of(span.attributes),
                    status=ProtoStatus.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano))
    return spans


class OtlpReceiver:
    """The receiver; `start()` (or `with`) serves, `stop()` ends. Safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._metrics: list[tuple[str, str]] = []  # (service.name, metric name) of every metric exported
        self.exports = 0  # requests decoded
        self.refused: list[str] = []  # why requests were refused (a test may assert there were none)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The URL to give `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`."""
        return f"http://127.0.0.1:{self.port}{PATH}"

    @property
    def metrics_endpoint(self) -> str:
        """The URL to give `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`."""
        return f"http://127.0.0.1:{self.port}{METRICS_PATH}"

    def metrics(self) -> list[tuple[str, str]]:
        """(service.name, metric name) of every metric received so far."""
        with self._lock:
            return list(self._metrics)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in the order they came."""
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far of one trace."""
        return [span for span in self.spans() if span.trace_id == trace_id]

    def _keep(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = spans_of(request)
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def _keep_metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        received = [(str(attributes_of(resource.resource.attributes).get("service.name", "")), metric.name)
                    for resource in request.resource_metrics for scope in resource.scope_metrics
                    for metric in scope.metrics]
        with self._lock:
            self._metrics.extend(received)
            self.exports += 1

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.refused.append(reason)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the exporter keeps its connection open between exports

            def do_POST(self) -> None:  # http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                path = self.path.split("?")[0]
                if path not in (PATH, METRICS_PATH):
                    receiver._refuse(f"POST {self.path}")
                    self._answer(404, b"", "text/plain")
                    return
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if content_type != PROTOBUF:
                    receiver._refuse(f"Content-Type {content_type!r}")
                    self._answer(415, b"", "text/plain")
                    return
                try:
                    encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    (receiver._keep if path == PATH else receiver._keep_metrics)(body)
                except Exception as exc:  # an export that does not decode is the sender's fault: say so
                    receiver._refuse(f"undecodable export: {exc!r}")
                    self._answer(400, b"", "text/plain")
                    return
                answer = ExportTraceServiceResponse() if path == PATH else ExportMetricsServiceResponse()
                self._answer(200, answer.SerializeToString(), PROTOBUF)

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test's output is for what failed

        return Handler
