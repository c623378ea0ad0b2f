"""structlog configured for JSON lines on stderr, with context (job, node, trace ids) merged in."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import msgspec
import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Put the current span's trace and span ids on every line, so logs join traces."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def _as_text(value: Any) -> Any:
    """What a value msgspec cannot encode is written as: its `repr`, as structlog's own renderer writes it."""
    return repr(value)


_ENCODER = msgspec.json.Encoder(enc_hook=_as_text)


def _dumps(event_dict: Any, **json_arguments: Any) -> str:
    """A line's JSON by msgspec's encoder: a service writes a line for each event it records, and json's
    costs three times as much. What msgspec refuses (a lone surrogate from undecodable bytes, a key that is
    not a string or a number) is written by json, as structlog writes it by default."""
    try:
        return _ENCODER.encode(event_dict).decode()
    except (TypeError, ValueError, UnicodeError, msgspec.EncodeError):
        return json.dumps(event_dict, **json_arguments)


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
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
