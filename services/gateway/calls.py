"""Asking the services as a caller: the operation looked up in the catalogue, sent on the caller's own NATS
connection, and every way it can fail turned into one `Refused` carrying the `CommandError` to show.

The HTTP API, the follow streams and the console's pages all ask through here, so a refusal reads the same
whichever door it came through.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client

from libs.contracts.operations.base import CommandError, Operation
from libs.contracts.operations.catalogue import BY_NAME
from libs.messaging.connection import LoginRefused
from libs.messaging.rpc import ServiceUnavailable, call_operation
from libs.telemetry.logs import get_logger
from services.gateway.connections import UserConnections

log = get_logger(__name__)

TIMEOUT_SECONDS = 10.0  # beyond it for a view of a past instant or a what-if: rpc.call_operation
OPENAPI_PATH = "/api/v1/openapi.json"


class Refused(Exception):
    def __init__(self, error: CommandError) -> None:
        super().__init__(error.message)
        self.error = error


def user_operation(name: str) -> Operation[Any, Any]:
    """The operation people may send by this name, or a refusal naming where the list is."""
    operation = BY_NAME.get(name)
    if operation is None or "user" not in operation.callers:
        raise Refused(CommandError(code="not-found", message=f"there is no operation {name!r}",
                                   hint=f"{OPENAPI_PATH} lists every operation"))
    return operation


class UserCalls:
    """Operations sent as the holder of a token, on that token's own connection."""

    def __init__(self, connections: UserConnections) -> None:
        self.connections = connections

    @contextlib.asynccontextmanager
    async def held(self, token: str) -> AsyncIterator[Client]:
        """The token's own connection, kept open while the block runs (a terminal's session lives on it), or
        `Refused` as `ask` refuses."""
        async with contextlib.AsyncExitStack() as holding:
            try:
                nc = await holding.enter_async_context(self.connections.held(token))
            except LoginRefused as exc:
                raise Refused(CommandError(code="unauthenticated", message=str(exc))) from None
            except Exception as exc:
                log.warning("gateway.nats_unreachable", error=str(exc))
                raise Refused(CommandError(code="unavailable", message="the gateway cannot reach NATS right now",
                                           hint="try again in a few seconds")) from None
            yield nc

    async def ask(self, operation: Operation[Any, Any], request: msgspec.Struct, token: str) -> Any:
        """The reply, or `Refused` with the service's refusal (or the gateway's, when nothing answered)."""
        async with self.held(token) as nc:
            return await self._ask_on(nc, operation, request, token)

    async def _ask_on(self, nc: Client, operation: Operation[Any, Any], request: msgspec.Struct, token: str) -> Any:
        try:
            reply = await call_operation(nc, operation, request, token=token, timeout=TIMEOUT_SECONDS)
        except ServiceUnavailable as exc:
            hint = f"the {operation.answered_by} does not answer; try again shortly"
            raise Refused(CommandError(code="unavailable", message=str(exc), hint=hint)) from None
        if isinstance(reply, CommandError):
            raise Refused(reply)
        return reply
