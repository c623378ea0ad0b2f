"""Reading what a request carries, within a bound: a body refused unread past its limit (by its Content-Length,
or as it arrives), and a form parsed only from such a body. Every door of the gateway reads through here, so no
request makes the gateway hold more than its limit in memory."""

from __future__ import annotations

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.types import Message

from libs.contracts.operations.base import CommandError
from services.gateway.calls import Refused

FORM_BYTES = 64 * 1024  # a console form without a file: a few fields, or the job ids of a batch delete


def too_large(limit: int) -> Refused:
    return Refused(CommandError(code="invalid-request", message=f"the request is over the limit of {limit} bytes"))


async def bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused unread past `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


async def bounded_form(request: Request, *, limit: int = FORM_BYTES, max_fields: int = 100,
                       max_files: int = 0) -> FormData:
    """The form, parsed from a body read within `limit` bytes."""
    body = await bounded_body(request, limit)
    sent = False

    async def replay() -> Message:  # the body read above, given to the form parser
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return await Request(request.scope, replay).form(max_files=max_files, max_fields=max_fields,
                                                     max_part_size=limit)


def form_text(form: FormData, name: str) -> str:
    """A form field's text, trimmed, its line breaks as `\n` (a browser sends a textarea's as `\r\n`); "" when
    the field is missing or a file."""
    value = form.get(name)
    return value.replace("\r\n", "\n").strip() if isinstance(value, str) else ""
