"""How the node agent serves its operations: libs/messaging/responder.py answers, over nats-py.

Every operation the catalogue has node agents answer (libs/contracts/operations/agents.py) is served here
for this node. The shared `Responder` decodes, authenticates, traces and turns failures into the one
`CommandError` shape, as it does for the services; what is the agent's own:

- who asks: the service that alone sends the request (the launcher, the monitor), or for an exec the job
  its token names; the operation's gate checks the launcher's or the monitor's signature
  (libs/controlsign.py), or the job's own token, before anything is done. A signed request let through is
  written down first, so that the next agent on the node refuses it too (agent/seen.py);
- a handler whose reply has to wait (a stop, until the processes are gone) returns `Later`, and the
  subscription goes on with other requests meanwhile; the span lasts until the reply is sent.

The agent speaks nats-py rather than faststream: it answers a handful of subjects of its own node, with
replies that may wait, and has no broker, queue groups or test broker to gain from one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, use_span

from libs.contracts.operations.base import Operation
from libs.messaging.responder import REPLY_REFUSED, Answer, Incoming, Later, Responder
from libs.natsroles import agent_request_sender
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, job_attributes

log = get_logger(__name__)

Request = TypeVar("Request")
Handler = Callable[[Request], Awaitable[Answer]]
# Why the request's sender may not ask it (None: it may), from the message and the decoded request.
Gate = Callable[[Msg, Request], str | None]


class RequestServer:
    """Serves the agent's operations on one connection."""

    def __init__(self, nc: Client, node: str) -> None:
        self.nc = nc
        self.node = node
        self.responder = Responder(node, node=node,
                                   caller_of=lambda incoming: agent_request_sender(node, incoming.subject))
        self._later: set[asyncio.Task[None]] = set()  # replies still being worked out

    def refuse_reply(self, operation: Operation[Any, Any], caller: str | None, reply_to: str, reason: str) -> None:
        """Log and count an answer for `operation` refused for where it was asked to go (nothing is sent there)."""
        self.responder.refuse_reply(operation.subject_for(self.node), caller, reply_to, reason)

    def part_span(self, operation: Operation[Any, Any], trace: Mapping[str, str], **job: str | int
                  ) -> AbstractContextManager[Span]:
        """The span of one part of a request that carries several (a start of start-processes): named and described
        as the request's own, but continuing the trace that part carries (its job's, with `job` as attributes)."""
        name, described = self.responder.span_described(operation.subject_for(self.node))
        attributes = {**described, **job_attributes(str(job.pop("job_id")), **job)}
        return self.responder.tracer.start_as_current_span(name, context=context_from_headers(trace),
                                                           kind=SpanKind.SERVER, attributes=attributes)

    async def serve(self, operation: Operation[Any, Any], handler: Handler[Any], gate: Gate[Any]) -> None:
        """Answer every request of `operation` to this node that `gate` lets through with what `handler` makes
        of it, or with why not."""

        async def on_request(msg: Msg) -> None:
            await self._answer(msg, operation, handler, gate)

        await self.nc.subscribe(operation.subject_for(self.node), cb=on_request)

    async def _answer(self, msg: Msg, operation: Operation[Any, Any], handler: Handler[Any],
                      gate: Gate[Any]) -> None:
        incoming = Incoming(subject=msg.subject, body=msg.data, headers=msg.headers, reply_to=msg.reply)
        began = time.perf_counter()
        span = self.responder.start_span(incoming)
        answered_later = False
        try:
            with use_span(span, end_on_exit=False):
                answer = await self.responder.answer(operation, handler, incoming, span,
                                                     gate=lambda _, request: gate(msg, request))
                if answer is None:  # refused for its reply subject: no answer anywhere, nothing done
                    self.responder.finished(incoming, span, began, REPLY_REFUSED)
                    return
                if isinstance(answer, Later):  # the task continues the span, and ends it once it replied
                    task = asyncio.create_task(self._answer_later(msg, operation, incoming, answer, span, began))
                    self._later.add(task)
                    task.add_done_callback(self._later.discard)
                    answered_later = True
                    return
                await self._reply(msg, operation, incoming, answer, span, began)
        finally:
            if not answered_later:
                span.end()

    async def _answer_later(self, msg: Msg, operation: Operation[Any, Any], incoming: Incoming, later: Later,
                            span: Span, began: float) -> None:
        try:
            try:
                reply = await later.reply
            except Exception as exc:
                reply = self.responder.failure(operation, exc, span)
            await self._reply(msg, operation, incoming, reply, span, began)
        finally:
            span.end()

    async def _reply(self, msg: Msg, operation: Operation[Any, Any], incoming: Incoming, reply: msgspec.Struct,
                     span: Span, began: float) -> None:
        body, error = self.responder.reply_body(operation, reply)
        try:
            await msg.respond(body)
        except nats.errors.Error as exc:  # no reply subject, or the connection is closing: nobody to tell
            log.warning("request.reply_not_sent", node=self.node, subject=msg.subject, error=str(exc))
        self.responder.finished(incoming, span, began, error, getattr(reply, "message", ""))
