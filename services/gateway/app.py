"""The HTTP API (`/api/v1/…`): each operation people send, as JSON, acting as the caller's token.

A request is checked at this edge before anything is sent: the operation must exist, the token must be there,
the body must fit the operation's bound and decode strictly into its request type; each refusal is a problem
(RFC 9457) naming the field as the CLI does. What passes goes to the answering service over NATS on the
caller's own connection (`connections.py`); the service's refusal comes back as a problem too.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from libs.auth import AuthError, bearer_token
from libs.contracts.operations.base import CommandError, Operation
from libs.contracts.operations.catalogue import BY_NAME
from libs.messaging.connection import LoginRefused
from libs.messaging.responder import decode_bounded
from libs.messaging.rpc import ServiceUnavailable, call_operation
from libs.natsroles import nats_user_for
from libs.telemetry.logs import get_logger
from services.gateway.connections import UserConnections
from services.gateway.openapi import API_PREFIX, openapi_document
from services.gateway.problems import MEDIA_TYPE, problem

log = get_logger(__name__)

TIMEOUT_SECONDS = 10.0  # beyond it for a view of a past instant or a what-if: rpc.call_operation


class Refused(Exception):
    def __init__(self, error: CommandError) -> None:
        super().__init__(error.message)
        self.error = error


def problem_response(error: CommandError, instance: str) -> Response:
    status, body = problem(error, instance=instance)
    return Response(msgspec.json.encode(body), status_code=status, media_type=MEDIA_TYPE)


def user_operation(name: str) -> Operation[Any, Any]:
    operation = BY_NAME.get(name)
    if operation is None or "user" not in operation.callers:
        raise Refused(CommandError(code="not-found", message=f"there is no operation {name!r}",
                                   hint=f"{API_PREFIX}/openapi.json lists every operation"))
    return operation


def caller_token(request: Request) -> str:
    """The caller's token; what is no token of ours is refused here, without a login to NATS."""
    hint = "send `Authorization: Bearer <token>`; `trainyard admin token` issues one"
    try:
        token = bearer_token(request.headers)
    except AuthError as exc:
        raise Refused(CommandError(code="unauthenticated", message=str(exc), hint=hint)) from None
    if nats_user_for(token) is None:
        raise Refused(CommandError(code="unauthenticated", message="the token is not a Trainyard token", hint=hint))
    return token


async def bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused unread past `limit` bytes (by its Content-Length, or as it arrives)."""
    too_large = CommandError(code="invalid-request", message=f"the request is over the limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(too_large)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Refused(too_large)
    return bytes(body)


class HttpApi:
    def __init__(self, connections: UserConnections) -> None:
        self.connections = connections
        self.document = msgspec.json.encode(openapi_document())

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route(f"{API_PREFIX}/openapi.json", self.openapi, methods=["GET"]),
            Route(API_PREFIX + "/{name}", self.operation, methods=["POST"]),
        ])

    async def openapi(self, _: Request) -> Response:
        return Response(self.document, media_type="application/json")

    async def operation(self, request: Request) -> Response:
        try:
            return await self._answer(request)
        except Refused as refused:
            return problem_response(refused.error, request.url.path)

    async def _answer(self, request: Request) -> Response:
        operation = user_operation(request.path_params["name"])
        token = caller_token(request)
        body = await bounded_body(request, operation.max_request_bytes)
        decoded = decode_bounded(body, operation.request, strict=True, max_bytes=operation.max_request_bytes)
        if isinstance(decoded, CommandError):
            raise Refused(decoded)
        reply = await self._ask(operation, decoded, token)
        if isinstance(reply, CommandError):
            raise Refused(reply)
        return Response(msgspec.json.encode(reply), media_type="application/json")

    async def _ask(self, operation: Operation[Any, Any], request: msgspec.Struct, token: str) -> Any:
        try:
            nc = await self.connections.for_token(token)
        except LoginRefused as exc:
            raise Refused(CommandError(code="unauthenticated", message=str(exc))) from None
        except Exception as exc:
            log.warning("gateway.nats_unreachable", error=str(exc))
            raise Refused(CommandError(code="unavailable", message="the gateway cannot reach NATS right now",
                                       hint="try again in a few seconds")) from None
        try:
            return await call_operation(nc, operation, request, token=token, timeout=TIMEOUT_SECONDS)
        except ServiceUnavailable as exc:
            hint = f"the {operation.answered_by} does not answer; try again shortly"
            raise Refused(CommandError(code="unavailable", message=str(exc), hint=hint)) from None
