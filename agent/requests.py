"""How the node agent answers requests: every subject it serves goes through `Responder.serve`.

Whoever sends the agent a request waits for a reply, so every request gets one: the handler's
reply; `invalid-request` naming what is wrong when the request does not decode into its contract
type; or `internal` when the handler fails. Requests come from the services, not from people, so
fields this agent does not know are passed over rather than refused: a newer launcher that adds one
still gets its processes started during a rolling upgrade. A handler whose reply has to wait (a
stop, until the processes are gone) returns `Later`, and the subscription goes on with other
requests meanwhile.

Before a request reaches its handler, its gate says whether its sender may ask it: the launcher's or the
monitor's signature (libs/controlsign.py) on what only they send, the job's own token on an exec. A
refused request gets `unauthenticated` with the reason, and nothing is done.
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

from libs.contracts.codec import encode
from libs.contracts.messages import CommandError
from libs.messaging.rpc import bounded, decode_request
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, tracer

log = get_logger(__name__)
span_tracer = tracer("trainyard.agent")

Request = TypeVar("Request")


@dataclass(frozen=True)
class Later:
    """A reply that is ready once `reply` completes, sent then without holding up other requests."""

    reply: Coroutine[Any, Any, msgspec.Struct]


Answer = msgspec.Struct | Later
Handler = Callable[[Request], Awaitable[Answer]]
# Why the request's sender may not ask it (None: it may), from the message and the decoded request.
Gate = Callable[[Msg, Request], str | None]


def refusal(node: str, request_type: type[Any], error: CommandError) -> CommandError:
    """The decoding's `invalid-request`, saying which node refused which request."""
    return msgspec.structs.replace(error, message=bounded(f"{node} refused {request_type.__name__}: {error.message}"))


def unauthenticated(node: str, request_type: type[Any], reason: str) -> CommandError:
    return refusal(node, request_type, CommandError(code="unauthenticated", message=reason))


def failure(node: str, request_type: type[Any], exc: Exception) -> CommandError:
    return CommandError(code="internal", message=bounded(f"{node} failed to handle {request_type.__name__}: {exc}"),
                        hint=f"see the log of the node agent on {node}")


class Responder:
    """Serves the agent's request subjects on one connection."""

    def __init__(self, nc: Client, node: str) -> None:
        self.nc = nc
        self.node = node
        self._later: set[asyncio.Task[None]] = set()  # replies still being worked out

    async def serve(self, subject: str, request_type: type[Request], handler: Handler[Request],
                    gate: Gate[Request]) -> None:
        """Answer every request on `subject` that `gate` lets through with what `handler` makes of it, or
        with why not."""

        async def on_request(msg: Msg) -> None:
            await self._answer(msg, request_type, handler, gate)

        await self.nc.subscribe(subject, cb=on_request)

    async def _answer(self, msg: Msg, request_type: type[Request], handler: Handler[Request],
                      gate: Gate[Request]) -> None:
        name = request_type.__name__
        with span_tracer.start_as_current_span(f"agent {name}", context=context_from_headers(msg.headers)):
            request = decode_request(msg.data, request_type, strict=False)
            if isinstance(request, CommandError):
                log.warning("agent.bad_request", node=self.node, request=name, error=request.message)
                await self._send(msg, refusal(self.node, request_type, request))
                return
            if (reason := gate(msg, request)) is not None:
                log.warning("agent.request_refused", node=self.node, request=name, reason=reason)
                await self._send(msg, unauthenticated(self.node, request_type, reason))
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
