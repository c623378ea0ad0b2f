"""structlog configured for JSON lines on stderr, with context (job, node, trace ids) merged in."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Put the current span's trace and span ids on every line, so logs join traces."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def configure_logging(service: str, level: str | None = None) -> None:
    """JSON logs for `service`; the level comes from TRAINYARD_LOG_LEVEL (default info)."""
    level_name = (level or os.environ.get("TRAINYARD_LOG_LEVEL", "info")).upper()
    numeric = logging.getLevelName(level_name)
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    # Library chatter (faststream's per-message lines) stays out of the way unless asked for.
    logging.getLogger("faststream").setLevel(max(numeric, logging.WARNING))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
