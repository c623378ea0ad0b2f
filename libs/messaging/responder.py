"""The one way every request is answered, by services and node agents alike (the catalogue's operations).

For each request, `Responder.answer`:

1. works out who asks (their NATS user) and refuses to answer anywhere but in that caller's own inbox
   (libs/natsroles.py `reply_refusal`): a request naming another reply subject (a stream's, the JetStream API,
   another's inbox) is neither answered nor carried out; it is logged and counted in
   `trainyard.requests.reply_refused`;
2. authenticates the sender as the operation says: a person's signed token (the handler gets the identity),
   the control plane's signature or a job's token (the answerer's `gate`), an agent's credential (the handler
   checks the headers itself);
3. decodes the body into the operation's request type, bounded in size: people's requests refuse unknown
   fields (a mistyped field is an error, not ignored); the control plane's pass them over, so that a newer
   sender's extra field does not stop an older agent during a rolling upgrade;
4. runs the handler in a server span that continues the caller's trace, and turns whatever goes wrong into
   one `CommandError` shape: `invalid-request`/`invalid-spec` for what does not decode, `unauthenticated`,
   `unavailable` for an outage of the database or NATS (nothing was done: try again), `internal` otherwise;
5. bounds the reply to one NATS message and records how long it took in `messaging.process.duration`.

The transport stays outside: services answer through faststream subscribers (libs/messaging/rpc.py
`serve_operations`), agents through nats-py (agent/requests.py), which also lets a reply wait (`Later`).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from opentelemetry.trace import Span, SpanKind

from libs.auth import AuthError, bearer_token, identity_from_headers
from libs.contracts.codec import decode_any, encode
from libs.contracts.jobspec import SpecError, field_error_from_msgspec
from libs.contracts.operations.base import MAX_REQUEST_BYTES, CommandError, Operation
from libs.contracts.strict import decode_strict
from libs.natsroles import nats_user_for, reply_refusal, user_nats_name
from libs.outages import OUTAGES
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import REPLIES_REFUSED, REQUEST_DURATION, attributes, counter, histogram
from libs.telemetry.tracing import context_from_headers, messaging_attributes, span_failed, tracer

log = get_logger(__name__)

# A reply must fit one message too; error texts that quote the request are cut to this length.
MAX_REPLY_BYTES = 1024 * 1024
MAX_ERROR_TEXT = 1000
# The code a refused reply subject is recorded with (span and request duration); no reply carries it.
REPLY_REFUSED = "reply-refused"


def bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}… ({len(text)} characters)"


@dataclass(frozen=True)
class Incoming:
    """A request as it arrived, whatever carried it."""

    subject: str
    body: bytes
    headers: Mapping[str, str] | None
    reply_to: str


@dataclass(frozen=True)
class Later:
    """A reply that is ready once `reply` completes: an agent sends it then, without holding up other
    requests (a stop, answered once the processes are gone)."""

    reply: Coroutine[Any, Any, msgspec.Struct]


Answer = msgspec.Struct | Later
# A handler gets the request, and the caller's identity (a person's operation), the message's headers
# (an agent's registration, which checks the credential in them itself) or nothing (control-plane requests,
# whose gate has checked the sender).
Handler = Callable[..., Awaitable[Any]]
# What a service serves: an operation of the catalogue and the handler that answers it.
Route = tuple[Operation[Any, Any], Handler]
# Why the sender may not ask this request (None: it may): the control plane's signature, a job's token.
Gate = Callable[[Incoming, Any], str | None]
# What tells the caller how far a long request has come: each update goes to its reply subject first.
Progress = Callable[[msgspec.Struct], Awaitable[None]]

_progress: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("request_progress", default=None)


def progress_reporter() -> Progress | None:
    """What tells the caller how far the request being answered has come (None outside a request)."""
    return _progress.get()


def claimed_caller(headers: Mapping[str, str] | None) -> str | None:
    """The NATS user the request's token names, unverified (None: no token of ours): whose inbox a reply may
    go to before, or without, the token being checked."""
    try:
        return nats_user_for(bearer_token(headers))
    except AuthError:
        return None


def decode_request(body: bytes, operation: Operation[Any, Any]) -> Any:
    """The request in `body`, or the `CommandError` that says why it is none. People's requests refuse unknown
    fields; the control plane's pass them over."""
    return decode_bounded(body, operation.request, strict=operation.authentication == "user-token",
                          max_bytes=operation.max_request_bytes)


def decode_bounded(body: bytes, message_type: Any, *, strict: bool, max_bytes: int = MAX_REQUEST_BYTES) -> Any:
    """The message in `body`, or the `CommandError` that says why it is none: too large, not JSON, not the
    type, or nested too deep."""
    if len(body) > max_bytes:
        return CommandError(code="invalid-request",
                            message=f"the request is {len(body)} bytes long, over the limit of {max_bytes}")
    try:
        return decode_strict(body, message_type) if strict else decode_any(body, message_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return error_for_decode_failure(exc)
    except Exception as exc:  # whatever else a hostile body makes the decoder raise (RecursionError)
        log.warning("request.undecodable", message_type=getattr(message_type, "__name__", "?"),
                    error=bounded(repr(exc)))
        return CommandError(code="invalid-request", message=bounded(f"the request cannot be decoded: {exc!r}"))


def error_for_decode_failure(exc: msgspec.ValidationError | msgspec.DecodeError) -> CommandError:
    """`invalid-request` (or `invalid-spec` inside a spec) naming what does not decode, in a few KiB at most
    however large the offending text."""
    if isinstance(exc, msgspec.ValidationError):
        problem = field_error_from_msgspec(exc)
        problem = msgspec.structs.replace(problem, field=bounded(problem.field), message=bounded(problem.message))
        if problem.field.startswith("spec."):
            problem = msgspec.structs.replace(problem, field=problem.field.removeprefix("spec."))
            return CommandError(code="invalid-spec", message=bounded(f"the job spec is invalid: {problem}"),
                                errors=[problem])
        return CommandError(code="invalid-request", message=bounded(str(problem)), errors=[problem])
    return CommandError(code="invalid-request", message=bounded(f"the request is not valid JSON: {exc}"))


def subject_template(subject: str, node: str) -> str:
    """`subject` with the node's name as `{node}`: what spans and metrics name, the same for every node."""
    return ".".join("{node}" if part == node else part for part in subject.split("."))


def count_refused_reply(destination: str) -> None:
    counter(REPLIES_REFUSED).add(1, attributes(REPLIES_REFUSED, destination))


class Responder:
    """Answers the requests of one process: a service (`answerer` its name) or a node agent (`node` set)."""

    def __init__(self, answerer: str, *, secret: str | None = None, node: str | None = None,
                 caller_of: Callable[[Incoming], str | None] | None = None) -> None:
        self.answerer = answerer  # named in errors: "the scheduler", "node-a"
        self.secret = secret  # verifies people's tokens
        self.node = node
        self.caller_of = caller_of  # who sends what the token does not say (the agent: the asking service)
        self.tracer = tracer(f"trainyard.{'agent' if node else answerer}")
        self.durations = histogram(REQUEST_DURATION)

    def template(self, subject: str) -> str:
        """`subject` with the node's name as `{node}`, so that spans and metrics name few subjects."""
        return subject if self.node is None else subject_template(subject, self.node)

    def caller(self, incoming: Incoming) -> str | None:
        """Who asks (their NATS user), as far as can be told before the request is authenticated."""
        return (self.caller_of(incoming) if self.caller_of else None) or claimed_caller(incoming.headers)

    def start_span(self, incoming: Incoming) -> Span:
        name, attributes_ = self.span_described(incoming.subject)
        return self.tracer.start_span(name, context=context_from_headers(incoming.headers), kind=SpanKind.SERVER,
                                      attributes=attributes_)

    def span_described(self, subject: str) -> tuple[str, dict[str, str]]:
        """The name and attributes of the server span of a request on `subject`, as the messaging conventions say."""
        template = self.template(subject)
        attributes_ = {**messaging_attributes(subject, "process"), "messaging.destination.template": template}
        if self.node:
            attributes_["trainyard.node"] = self.node
        return f"process {template}", attributes_

    def refuse_reply(self, subject: str, caller: str | None, reply_to: str, reason: str) -> None:
        """Log and count an answer to a request on `subject` refused for where it was asked to go (`reply_to`):
        nothing is sent there."""
        template = self.template(subject)
        log.warning("request.reply_refused", answerer=self.answerer, subject=template, caller=caller or "unknown",
                    reply_to=bounded(reply_to), reason=reason)
        count_refused_reply(template)

    async def answer(self, operation: Operation[Any, Any], handler: Handler, incoming: Incoming, span: Span, *,
                     gate: Gate | None = None, progress: Progress | None = None) -> Answer | None:
        """The reply to `incoming` (or `Later`), or None when it must not be answered at all (its reply subject
        is not the caller's own inbox: nothing is done)."""
        identity = None
        refused: str | None = None
        caller = self.caller(incoming)
        if operation.authentication == "user-token":
            try:
                identity = identity_from_headers(self.secret or "", incoming.headers)
                caller = user_nats_name(identity.user)
            except AuthError as exc:
                refused = str(exc)
        if incoming.reply_to and (reason := reply_refusal(caller, incoming.reply_to)) is not None:
            self.refuse_reply(incoming.subject, caller, incoming.reply_to, reason)
            return None
        if refused is not None:
            return CommandError(code="unauthenticated", message=refused)
        if identity is not None:
            span.set_attribute("enduser.id", identity.user)
        request = decode_request(incoming.body, operation)
        if isinstance(request, CommandError):
            log.warning("request.undecoded", answerer=self.answerer, operation=operation.name, error=request.message)
            return request
        for key, field in (("trainyard.job.id", "job_id"), ("trainyard.attempt", "attempt")):
            if isinstance(value := getattr(request, field, None), str | int):
                span.set_attribute(key, value)
        if gate is not None and (reason := gate(incoming, request)) is not None:
            log.warning("request.refused", answerer=self.answerer, operation=operation.name, reason=reason)
            return CommandError(code="unauthenticated", message=bounded(f"{self.answerer} refused {operation.name}: "
                                                                        f"{reason}"))
        _progress.set(progress)
        try:
            answer: Answer
            if operation.authentication == "user-token":
                answer = await handler(request, identity)
            elif operation.authentication == "agent-credential":
                answer = await handler(request, incoming.headers)
            else:
                answer = await handler(request)
            return answer
        except Exception as exc:
            return self.failure(operation, exc, span)

    def failure(self, operation: Operation[Any, Any], exc: Exception, span: Span) -> CommandError:
        """The one shape of a handler's failure: what the caller can do about it."""
        from libs.eventstore.store import EventTooLarge  # the store is the services' alone

        if isinstance(exc, SpecError):
            return CommandError(code="invalid-spec", message=f"the job spec is invalid: {exc}", errors=exc.errors)
        if isinstance(exc, EventTooLarge):
            log.warning("request.event_too_large", operation=operation.name, error=str(exc))
            return CommandError(code="invalid-request", message=f"the request was not recorded: {exc}",
                                hint="shorten the longest fields of the request; nothing was changed")
        if isinstance(exc, OUTAGES):  # nothing was done: the caller may try again once it passes
            log.warning("request.outage", operation=operation.name, error=bounded(repr(exc)))
            return CommandError(code="unavailable", hint="try again in a few seconds",
                                message=f"the {self.answerer} cannot reach its database or NATS right now: "
                                        f"{exc!r:.200}")
        log.exception("request.failed", answerer=self.answerer, operation=operation.name)
        span.record_exception(exc)
        where = f"the node agent on {self.node}" if self.node else f"the {self.answerer}"
        return CommandError(code="internal", message=bounded(f"{where} failed to handle {operation.name}: {exc}"),
                            hint=f"see the log of {where} for details")

    def reply_body(self, operation: Operation[Any, Any], reply: msgspec.Struct) -> tuple[bytes, str]:
        """The reply's bytes, bounded to one message, and the code of the error it tells of (empty for none)."""
        body = encode(reply)
        if len(body) > MAX_REPLY_BYTES:
            log.error("request.reply_too_large", operation=operation.name, size=len(body))
            reply = CommandError(code="internal", message=f"the reply of {len(body)} bytes is over the limit of "
                                 f"{MAX_REPLY_BYTES}", hint="ask for less at once (fewer jobs, a shorter range)")
            body = encode(reply)
        return body, reply.code if isinstance(reply, CommandError) else ""

    def finished(self, incoming: Incoming, span: Span, began: float, error: str, message: str = "") -> None:
        """Record how long the request took and, for a refusal, its code."""
        if error:
            span_failed(span, error, bounded(message or error))
        self.durations.record(time.perf_counter() - began,
                              attributes(REQUEST_DURATION, "nats", self.template(incoming.subject), error))
