"""Trace context with traces off: spans record nothing, yet every message and log line carries the ids."""

from __future__ import annotations

from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer_provider

PARENT_TRACE = "4909e7bbe1d6ab1c3b31bcfb897b1915"
PARENT_SPAN = "94169f4ec9fd2077"


def traceparent(flags: str = "01") -> dict[str, str]:
    return {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-{flags}"}


def test_with_traces_off_a_span_continues_the_trace_it_was_given_and_records_nothing() -> None:
    tracer = tracer_provider("scheduler", "off").get_tracer("trainyard.scheduler")
    with tracer.start_as_current_span("scheduler admit", context=context_from_headers(traceparent())) as span:
        passed_on = current_trace_headers()["traceparent"]
        recording = span.is_recording()
    version, trace_id, span_id, flags = passed_on.split("-")
    assert (version, trace_id, flags) == ("00", PARENT_TRACE, "01")
    assert span_id not in (PARENT_SPAN, "0" * 16)
    assert not recording


def test_with_traces_off_a_parent_that_was_not_sampled_stays_so() -> None:
    tracer = tracer_provider("launcher", "off").get_tracer("trainyard.launcher")
    with tracer.start_as_current_span("launcher plan", context=context_from_headers(traceparent("00"))):
        passed_on = current_trace_headers()["traceparent"]
    assert passed_on.startswith(f"00-{PARENT_TRACE}-") and passed_on.endswith("-00")


def test_with_traces_off_a_span_without_a_parent_starts_a_trace_of_its_own() -> None:
    tracer = tracer_provider("monitor", "off").get_tracer("trainyard.monitor")
    with tracer.start_as_current_span("monitor patrol"):
        first = current_trace_headers()["traceparent"]
    with tracer.start_as_current_span("monitor patrol"):
        second = current_trace_headers()["traceparent"]
    assert first.split("-")[1] != second.split("-")[1]
    assert first.split("-")[1] != "0" * 32
    assert current_trace_headers() == {}  # no span open: nothing to pass on


def test_with_traces_on_spans_are_recorded_for_the_exporter() -> None:
    provider = tracer_provider("scheduler", "console")
    try:
        tracer = provider.get_tracer("trainyard.scheduler")
        with tracer.start_as_current_span("scheduler admit", context=context_from_headers(traceparent())) as span:
            assert span.is_recording()
            assert current_trace_headers()["traceparent"].startswith(f"00-{PARENT_TRACE}-")
    finally:
        provider.shutdown()  # type: ignore[attr-defined]


def test_each_message_continues_its_own_trace_whatever_else_its_headers_carry() -> None:
    """Extracted contexts are kept by the trace fields only: the same trace with another message id is the same
    context, another trace (or its sampling flag) is never mistaken for one seen before."""
    from opentelemetry import trace

    def continued(headers: dict[str, str]) -> trace.SpanContext:
        return trace.get_current_span(context_from_headers(headers)).get_span_context()

    first = continued({**traceparent(), "Nats-Msg-Id": "a"})
    again = continued({**traceparent(), "Nats-Msg-Id": "b"})
    other = continued({"traceparent": f"00-{'1' * 32}-{PARENT_SPAN}-01", "Nats-Msg-Id": "a"})
    unsampled = continued(traceparent("00"))
    assert (format(first.trace_id, "032x"), first.is_remote) == (PARENT_TRACE, True)
    assert again == first
    assert format(other.trace_id, "032x") == "1" * 32
    assert (unsampled.trace_id, unsampled.trace_flags.sampled) == (first.trace_id, False)
    assert not trace.get_current_span(context_from_headers({"Nats-Msg-Id": "a"})).get_span_context().is_valid
