"""OpenTelemetry set-up and the propagation of trace context through NATS headers.

The exporter is chosen by TRAINYARD_TRACES: `otlp` (endpoint from the standard OTEL_EXPORTER_OTLP_*
variables), `console`, or `off` (the default, and what tests use). Context travels in the W3C
`traceparent`/`tracestate` headers of every NATS message and is stored with each event, so a job's
spans join one trace from submit through scheduler, launcher and agent.

With traces off nothing is exported, so spans record nothing but their ids (libs/telemetry/ids_only.py):
logs still carry trace ids, and a job's ids still join one trace across processes.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

# OpenTelemetry is imported by the functions that use it: a process that only sends requests (the
# CLI) never traces, and importing the SDK would cost it a good share of its start-up.
if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import TextMapPropagator

_configured = False


def configure_tracing(service: str) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    from opentelemetry import trace

    trace.set_tracer_provider(tracer_provider(service, os.environ.get("TRAINYARD_TRACES", "off").lower()))


def tracer_provider(service: str, mode: str) -> trace.TracerProvider:
    """The provider for TRAINYARD_TRACES=`mode`: the SDK's with its exporter, or one that records nothing."""
    if mode not in ("console", "otlp"):
        from libs.telemetry.ids_only import IdsOnlyTracerProvider

        return IdsOnlyTracerProvider()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": f"trainyard-{service}"}))
    exporter: SpanExporter
    if mode == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def shutdown_tracing() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    from opentelemetry import trace

    return trace.get_tracer(name)


def current_trace_headers() -> dict[str, str]:
    """The current context as headers (`traceparent`, `tracestate`) to put on a NATS message."""
    if "opentelemetry.context" not in sys.modules:
        return {}  # nothing has loaded OpenTelemetry, so no span is open: nothing to pass on
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context:
    from opentelemetry.context import Context
    from opentelemetry.propagate import get_global_textmap

    if not headers:
        return Context()  # no headers: no trace to continue
    propagator = get_global_textmap()
    fields = _fields_read(propagator)
    return _extracted(propagator, tuple(headers.get(name) for name in fields), fields)


# A job's trace headers are extracted again for every message about it, in every process it passes through:
# the contexts (immutable) of the last few traces are kept, by the values of the fields the propagator reads.
@functools.lru_cache(maxsize=4)
def _fields_read(propagator: TextMapPropagator) -> tuple[str, ...]:
    return tuple(sorted(propagator.fields))


@functools.lru_cache(maxsize=1024)
def _extracted(propagator: TextMapPropagator, values: tuple[str | None, ...],
               fields: tuple[str, ...]) -> otel_context.Context:
    return propagator.extract({name: value for name, value in zip(fields, values, strict=True) if value is not None})


def messaging_attributes(destination: str, operation: str) -> dict[str, str]:
    """A span's attributes for handling a NATS message, as OpenTelemetry's messaging conventions name them:
    `operation` is `process` (a request answered, an event reacted to), `send` or `receive`."""
    kind = operation if operation in ("process", "send", "receive") else "process"
    return {"messaging.system": "nats", "messaging.destination.name": destination,
            "messaging.operation.name": operation, "messaging.operation.type": kind}


def send_span(span_tracer: trace.Tracer, subject_of: Callable[[str], str], node: str, *, job_id: str,
              trace_headers: Mapping[str, str] | None = None,
              **attributes: str | int) -> AbstractContextManager[trace.Span]:
    """The client span of a request to `node`'s agent on `subject_of(node)`, continuing `trace_headers` (else the
    current context), named as OpenTelemetry's messaging conventions name a send, after the subject's template
    (`send trainyard.agent.{node}.start`) so that names stay few; `attributes` are set as `trainyard.<name>`."""
    from opentelemetry.trace import SpanKind

    template = subject_of("{node}")
    return span_tracer.start_as_current_span(
        f"send {template}", context=context_from_headers(trace_headers) if trace_headers is not None else None,
        kind=SpanKind.CLIENT,
        attributes={**messaging_attributes(subject_of(node), "send"), "messaging.destination.template": template,
                    **job_attributes(job_id, node=node, **attributes)})


def job_attributes(job_id: str, **attributes: str | int) -> dict[str, str | int]:
    """A span's attributes about a job: its id as `trainyard.job.id`, and each of `attributes` as `trainyard.<name>`."""
    return {"trainyard.job.id": job_id, **{f"trainyard.{key}": value for key, value in attributes.items()}}


def span_failed(span: trace.Span, error_type: str, message: str) -> None:
    """Mark `span` as failed: its `error.type` (a refusal's code, an exception's kind) and why (`message`, which the
    caller keeps short)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))
