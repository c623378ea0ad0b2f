"""How the node agent answers requests: every subject it serves goes through `Responder.serve`.

Whoever sends the agent a request waits for a reply, so every request gets one: the handler's
reply; `invalid-request` naming what is wrong when the request does not decode into its contract
type; or `internal` when the handler fails. Requests come from the services, not from people, so
fields this agent does not know are passed over rather than refused: a newer launcher that adds one
still gets its processes started during a rolling upgrade. A handler whose reply has to wait (a
stop, until the processes are gone) returns `Later`, and the subscription goes on with other
requests meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts.codec import decode, encode
from libs.contracts.messages import CommandError
from libs.messaging.rpc import MAX_REQUEST_BYTES, error_for_decode_failure
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, tracer

log = get_logger(__name__)
span_tracer = tracer("trainyard.agent")

# Error texts may quote the request: bounded, so a refusal always fits in one message.
MAX_ERROR_TEXT = 1000

Request = TypeVar("Request")


@dataclass(frozen=True)
class Later:
    """A reply that is ready once `reply` completes, sent then without holding up other requests."""

    reply: Coroutine[Any, Any, msgspec.Struct]


Answer = msgspec.Struct | Later
Handler = Callable[[Request], Awaitable[Answer]]


def bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}… ({len(text)} characters)"


def refusal(node: str, request_type: type[Any], exc: msgspec.DecodeError) -> CommandError:
    """`invalid-request` for a request that does not decode, saying which request and what is wrong."""
    error = error_for_decode_failure(exc)
    return CommandError(code="invalid-request", message=bounded(f"{node} refused {request_type.__name__}: "
                                                                f"{error.message}"),
                        errors=[msgspec.structs.replace(e, field=bounded(e.field), message=bounded(e.message))
                                for e in error.errors])


def failure(node: str, request_type: type[Any], exc: Exception) -> CommandError:
    return CommandError(code="internal", message=bounded(f"{node} failed to handle {request_type.__name__}: {exc}"),
                        hint=f"see the log of the node agent on {node}")


class Responder:
    """Serves the agent's request subjects on one connection."""

    def __init__(self, nc: Client, node: str) -> None:
        self.nc = nc
        self.node = node
        self._later: set[asyncio.Task[None]] = set()  # replies still being worked out

    async def serve(self, subject: str, request_type: type[Request], handler: Handler[Request]) -> None:
        """Answer every request on `subject` with what `handler` makes of it, or with why not."""

        async def on_request(msg: Msg) -> None:
            await self._answer(msg, request_type, handler)

        await self.nc.subscribe(subject, cb=on_request)

    async def _answer(self, msg: Msg, request_type: type[Request], handler: Handler[Request]) -> None:
        name = request_type.__name__
        with span_tracer.start_as_current_span(f"agent {name}", context=context_from_headers(msg.headers)):
            if len(msg.data) > MAX_REQUEST_BYTES:
                log.warning("agent.bad_request", node=self.node, request=name, size=len(msg.data))
                await self._send(msg, refusal(self.node, request_type, msgspec.DecodeError(
                    f"the request is {len(msg.data)} bytes long, over the limit of {MAX_REQUEST_BYTES}")))
                return
            try:
                request: Request = decode(msg.data, request_type)
            except msgspec.DecodeError as exc:  # ValidationError too: a message that does not fit the type
                log.warning("agent.bad_request", node=self.node, request=name, error=bounded(str(exc)))
                await self._send(msg, refusal(self.node, request_type, exc))
                return
            except Exception as exc:  # RecursionError on deep nesting, or whatever else the decoder raises
                log.warning("agent.bad_request", node=self.node, request=name, error=bounded(repr(exc)))
                await self._send(msg, refusal(self.node, request_type,
                                              msgspec.DecodeError(f"the request cannot be decoded: {exc!r}")))
                return
            try:
                answer = await handler(request)
            except Exception as exc:
                log.exception("agent.request_failed", node=self.node, request=name)
                await self._send(msg, failure(self.node, request_type, exc))
                return
            if isinstance(answer, Later):
                task = asyncio.create_task(self._answer_later(msg, request_type, answer))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
            else:
                await self._send(msg, answer)

    async def _answer_later(self, msg: Msg, request_type: type[Any], later: Later) -> None:
        try:
            reply = await later.reply
        except Exception as exc:
            log.exception("agent.request_failed", node=self.node, request=request_type.__name__)
            reply = failure(self.node, request_type, exc)
        await self._send(msg, reply)

    async def _send(self, msg: Msg, reply: msgspec.Struct) -> None:
        try:
            await msg.respond(encode(reply))
        except nats.errors.Error as exc:  # no reply subject, or the connection is closing: nobody to tell
            log.warning("agent.reply_not_sent", node=self.node, subject=msg.subject, error=str(exc))
