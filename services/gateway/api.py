"""The HTTP API (`/api/v1/…`): each operation people send, as JSON, acting as the caller.

A request is checked at this edge before anything is sent: the operation must exist, the caller must be known
(a bearer token, or a console session with its CSRF token), the body must fit the operation's bound and decode
strictly into its request type; each refusal is a problem (RFC 9457) naming the field as the CLI does. What
passes goes to the answering service over NATS on the caller's own connection (`calls.py`); the service's
refusal comes back as a problem too.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from libs.contracts.operations.base import CommandError
from libs.messaging.responder import decode_bounded
from services.gateway.bodies import bounded_body
from services.gateway.calls import Refused, UserCalls, user_operation
from services.gateway.openapi import API_PREFIX, openapi_document
from services.gateway.problems import problem_response
from services.gateway.sessions import Sessions, caller_of


class HttpApi:
    def __init__(self, calls: UserCalls, sessions: Sessions) -> None:
        self.calls = calls
        self.sessions = sessions
        self.document = msgspec.json.encode(openapi_document())

    def routes(self) -> list[Route]:
        return [
            Route(f"{API_PREFIX}/openapi.json", self.openapi, methods=["GET"]),
            Route(API_PREFIX + "/{name}", self.operation, methods=["POST"]),
        ]

    async def openapi(self, _: Request) -> Response:
        return Response(self.document, media_type="application/json")

    async def operation(self, request: Request) -> Response:
        try:
            return await self._answer(request)
        except Refused as refused:
            return problem_response(refused.error, request.url.path)

    async def _answer(self, request: Request) -> Response:
        operation = user_operation(request.path_params["name"])
        caller = caller_of(request, self.sessions)
        body = await bounded_body(request, operation.max_request_bytes)
        decoded = decode_bounded(body, operation.request, strict=True, max_bytes=operation.max_request_bytes)
        if isinstance(decoded, CommandError):
            raise Refused(decoded)
        reply = await self.calls.ask(operation, decoded, caller.token)
        return Response(msgspec.json.encode(reply), media_type="application/json")
