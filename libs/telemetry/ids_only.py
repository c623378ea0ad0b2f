"""Spans that record nothing but their ids: what tracing costs when no exporter would read the spans.

Each span continues its parent's trace (or starts one) with a span id of its own and the trace flags the
SDK's default sampler would give it (sampled, unless the parent said not), so the ids still reach the logs
and the NATS headers, and a process downstream with traces on continues the same traces. What an SDK span
keeps beside them (name, attributes, events, timings) would go nowhere, and is not kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.util._decorator import _agnosticcontextmanager

_IDS = RandomIdGenerator()
_NEW_TRACE = trace.TraceFlags(trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)


class IdsOnlyTracer(trace.Tracer):
    def start_span(self, name: str, context: otel_context.Context | None = None, *args: Any,
                   **kwargs: Any) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            trace_id, flags = parent.trace_id, parent.trace_flags
        else:
            trace_id, flags = _IDS.generate_trace_id(), _NEW_TRACE
        return trace.NonRecordingSpan(trace.SpanContext(trace_id, _IDS.generate_span_id(), is_remote=False,
                                                        trace_flags=flags))

    @_agnosticcontextmanager
    def start_as_current_span(self, name: str, context: otel_context.Context | None = None, *args: Any,
                              end_on_exit: bool = True, **kwargs: Any) -> Iterator[trace.Span]:
        with trace.use_span(self.start_span(name, context), end_on_exit=end_on_exit) as span:
            yield span


class IdsOnlyTracerProvider(trace.TracerProvider):
    def __init__(self) -> None:
        self._tracer = IdsOnlyTracer()

    def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self._tracer
