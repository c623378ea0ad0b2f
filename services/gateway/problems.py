"""Refusals as RFC 9457 problem details: a `CommandError` of any service, or the gateway's own at its edge.

The body names what was wrong as the CLI does (`code`, `detail`, `hint`, and `errors` with each field), and
its HTTP status says which kind of refusal it is, so that an HTTP client needs no Trainyard knowledge to act.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

from libs.contracts.operations.base import CommandError, ErrorCode

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "urn:trainyard:problem:"  # a problem's `type`: this and its code, e.g. urn:trainyard:problem:not-found

STATUS: dict[ErrorCode, int] = {
    "invalid-request": 400,
    "invalid-spec": 422,
    "not-found": 404,
    "conflict": 409,
    "invalid-state": 409,
    "unauthenticated": 401,
    "forbidden": 403,
    "over-cap": 429,
    "unavailable": 503,
    "internal": 500,
}
TITLES: dict[ErrorCode, str] = {
    "invalid-request": "The request is not valid",
    "invalid-spec": "The job spec is not valid",
    "not-found": "No such thing, or not yours to see",
    "conflict": "It conflicts with what exists",
    "invalid-state": "Not in this state",
    "unauthenticated": "No valid token",
    "forbidden": "Not allowed",
    "over-cap": "Over a limit",
    "unavailable": "Not available right now",
    "internal": "The platform failed",
}


def problem(error: CommandError, *, instance: str = "") -> tuple[int, dict[str, Any]]:
    """The HTTP status and problem-details body of a refusal."""
    body: dict[str, Any] = {"type": TYPE_BASE + error.code, "title": TITLES.get(error.code, error.code),
                            "status": STATUS.get(error.code, 500), "detail": error.message, "code": error.code}
    if error.hint:
        body["hint"] = error.hint
    if error.errors:
        body["errors"] = msgspec.to_builtins(error.errors)
    if instance:
        body["instance"] = instance
    return body["status"], body


def problem_body_response(body: dict[str, Any], status: int, headers: Mapping[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type=MEDIA_TYPE, headers=headers)


def problem_response(error: CommandError, instance: str, headers: Mapping[str, str] | None = None) -> Response:
    """A refusal as the HTTP answer: its status, and the problem-details body."""
    status, body = problem(error, instance=instance)
    return problem_body_response(body, status, headers)
