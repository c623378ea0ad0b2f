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
signed request let through is written down first, so that the next agent on the node refuses it too
(agent/seen.py). A refused request gets `unauthenticated` with the reason, and nothing is done.

An answer goes only to the caller's own inbox: the launcher's or the monitor's for what only that service
sends, a job's for its exec (the job its token names). A request naming any other reply subject (a
stream's, the JetStream API, another's inbox) is neither answered nor carried out: it is logged and
counted in `trainyard.requests.reply_refused` (libs/natsroles.py `reply_refusal`).

Each request is handled in a span `process <subject template>` (the subject with the node's name as `{node}`,
so that names stay few), a server span with OpenTelemetry's messaging attributes that continues the sender's
trace and lasts until the reply is sent, a `Later` one's too. How long it took is recorded in
`messaging.process.duration`, by the same template, with the refusal's code as `error.type`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, use_span

from libs.contracts.codec import encode
from libs.contracts.messages import CommandError
from libs.messaging.rpc import bounded, claimed_caller, count_refused_reply, decode_request
from libs.natsroles import agent_request_sender, reply_refusal
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import REQUEST_DURATION, attributes, histogram
from libs.telemetry.tracing import context_from_headers, messaging_attributes, span_failed, tracer

log = get_logger(__name__)
span_tracer = tracer("trainyard.agent")
_durations = histogram(REQUEST_DURATION)

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


def reply_refused(node: str, template: str, caller: str | None, reply: str, reason: str) -> None:
    """Log and count a request refused for where it asks the answer to go (nothing is sent there)."""
    log.warning("agent.reply_refused", node=node, subject=template, caller=caller or "unknown",
                reply_to=bounded(reply), reason=reason)
    count_refused_reply(template)


def subject_template(subject: str, node: str) -> str:
    """`subject` with the node's name as `{node}`: what spans and metrics name, the same for every node."""
    return ".".join("{node}" if part == node else part for part in subject.split("."))


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
        template = subject_template(subject, self.node)

        async def on_request(msg: Msg) -> None:
            await self._answer(msg, template, request_type, handler, gate)

        await self.nc.subscribe(subject, cb=on_request)

    def caller(self, msg: Msg) -> str | None:
        """Who asks (its NATS user): the service that alone sends this request, or else (an exec) the job its
        token names; the gate checks the signature or the token before anything is done."""
        return agent_request_sender(self.node, msg.subject) or claimed_caller(msg.headers)

    async def _answer(self, msg: Msg, template: str, request_type: type[Request], handler: Handler[Request],
                      gate: Gate[Request]) -> None:
        caller = self.caller(msg)
        if msg.reply and (reason := reply_refusal(caller, msg.reply)) is not None:
            reply_refused(self.node, template, caller, msg.reply, reason)  # no answer anywhere, nothing done
            return
        began = time.perf_counter()
        span = span_tracer.start_span(
            f"process {template}", context=context_from_headers(msg.headers), kind=SpanKind.SERVER,
            attributes={**messaging_attributes(msg.subject, "process"), "messaging.destination.template": template,
                        "trainyard.node": self.node})
        answered_later = False
        try:
            with use_span(span, end_on_exit=False):
                answer = await self._handle(msg, request_type, handler, gate, span)
                if isinstance(answer, Later):  # the task continues the span, and ends it once it replied
                    task = asyncio.create_task(self._answer_later(msg, template, request_type, answer, span, began))
                    self._later.add(task)
                    task.add_done_callback(self._later.discard)
                    answered_later = True
                    return
                await self._reply(msg, template, answer, span, began)
        finally:
            if not answered_later:
                span.end()

    async def _handle(self, msg: Msg, request_type: type[Request], handler: Handler[Request],
                      gate: Gate[Request], span: Span) -> Answer:
        """The handler's answer, or the refusal that says why there is none."""
        name = request_type.__name__
        request = decode_request(msg.data, request_type, strict=False)
        if isinstance(request, CommandError):
            log.warning("agent.bad_request", node=self.node, request=name, error=request.message)
            return refusal(self.node, request_type, request)
        for key, field in (("trainyard.job.id", "job_id"), ("trainyard.attempt", "attempt")):
            if isinstance(value := getattr(request, field, None), str | int):
                span.set_attribute(key, value)
        if (reason := gate(msg, request)) is not None:
            log.warning("agent.request_refused", node=self.node, request=name, reason=reason)
            return unauthenticated(self.node, request_type, reason)
        try:
            return await handler(request)
        except Exception as exc:
            log.exception("agent.request_failed", node=self.node, request=name)
            span.record_exception(exc)
            return failure(self.node, request_type, exc)

    async def _answer_later(self, msg: Msg, template: str, request_type: type[Any], later: Later, span: Span,
                            began: float) -> None:
        try:
            try:
                reply = await later.reply
            except Exception as exc:
                log.exception("agent.request_failed", node=self.node, request=request_type.__name__)
                span.record_exception(exc)
                reply = failure(self.node, request_type, exc)
            await self._reply(msg, template, reply, span, began)
        finally:
            span.end()

    async def _reply(self, msg: Msg, template: str, reply: msgspec.Struct, span: Span, began: float) -> None:
        """Send the reply; record how long the request took and, for a refusal, its code."""
        await self._send(msg, reply)
        error_type = ""
        if isinstance(reply, CommandError):
            error_type = reply.code
            span_failed(span, error_type, bounded(reply.message))
        _durations.record(time.perf_counter() - began, attributes(REQUEST_DURATION, "nats", template, error_type))

    async def _send(self, msg: Msg, reply: msgspec.Struct) -> None:
        try:
            await msg.respond(encode(reply))
        except nats.errors.Error as exc:  # no reply subject, or the connection is closing: nobody to tell
            log.warning("agent.reply_not_sent", node=self.node, subject=msg.subject, error=str(exc))
