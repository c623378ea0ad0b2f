"""Request/reply over core NATS with typed messages: the service side (faststream) and the caller.

A responder decodes the request into its contract type, runs the handler inside a span that
continues the caller's trace, and always answers: with the handler's reply, or with a
`CommandError` that says what was wrong. Nothing reaches the handler that failed to decode.

It answers only in the caller's own inbox (libs/natsroles.py `reply_refusal`): the caller is who the
request's token names (verified, for a handler that authenticates). A request whose reply subject is
anything else (another's inbox, a stream's subject, the JetStream API) gets no answer at all and is
not carried out; it is logged with the subject and the caller, and counted in
`trainyard.requests.reply_refused`.

Callers (the CLI among them) import this module for `call` alone, so faststream and the service
logger are imported by the functions that register responders, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from libs.auth import AuthError, bearer_headers, bearer_token, identity_from_headers
from libs.contracts.codec import decode_any, encode
from libs.contracts.identity import Identity
from libs.contracts.jobspec import SpecError, field_error_from_msgspec
from libs.contracts.messages import CommandError, Reply
from libs.contracts.strict import decode_strict
from libs.natsroles import nats_user_for, reply_refusal, user_nats_name
from libs.outages import OUTAGES
from libs.telemetry.tracing import context_from_headers, current_trace_headers, messaging_attributes, tracer

if TYPE_CHECKING:
    from faststream.nats import NatsBroker

    from libs.controlsign import ControlSigner

# A handler's progress on a long request: sent to the request's reply subject before its reply (`progress_reporter`),
# read by `call_with_progress`. Set by the responder for each request.
_progress: contextvars.ContextVar[Callable[[msgspec.Struct], Awaitable[None]] | None] = contextvars.ContextVar(
    "rpc_progress", default=None)


def progress_reporter() -> Callable[[msgspec.Struct], Awaitable[None]] | None:
    """What tells the caller how far the request being answered has come (None outside a request): each update
    is sent to its reply subject, before the reply."""
    return _progress.get()


RequestHandler = Callable[[Any], Awaitable[Any]]
AuthenticatedHandler = Callable[[Any, Identity], Awaitable[Any]]


# The largest request body decoded: NATS's default max payload. A server configured for larger
# messages still gets nothing bigger decoded (the largest valid request, a spec at its limit, is a
# quarter of this); a bigger body is refused unread.
MAX_REQUEST_BYTES = 1024 * 1024
# A reply must fit one message too; error texts that quote the request are cut to this length.
MAX_REPLY_BYTES = 1024 * 1024
MAX_ERROR_TEXT = 1000
# People's requests one service process answers at once: a command waiting for its append (with others, in
# one transaction) must not hold up the requests behind it. Each handler takes the service's lock itself for
# what it changes.
REQUEST_WORKERS = 64


def bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}… ({len(text)} characters)"


def error_for_decode_failure(exc: msgspec.ValidationError | msgspec.DecodeError) -> CommandError:
    """`invalid-request` (or `invalid-spec` inside a spec) naming what does not decode, in a few KiB
    at most however large the offending text."""
    error = _error_for_decode_failure(exc)
    return msgspec.structs.replace(
        error, message=bounded(error.message),
        errors=[msgspec.structs.replace(e, field=bounded(e.field), message=bounded(e.message)) for e in error.errors])


def decode_request(body: bytes, request_type: Any, *, strict: bool = True) -> Any:
    """The request in `body`, or the `CommandError` that says why it is none: too large, not JSON, not
    the type, or nested too deep. `strict` refuses unknown fields (people's requests); services' requests
    to agents pass them over, so a newer sender's extra field does not stop an older receiver."""
    if len(body) > MAX_REQUEST_BYTES:
        return CommandError(code="invalid-request",
                            message=f"the request is {len(body)} bytes long, over the limit of {MAX_REQUEST_BYTES}")
    try:
        return decode_strict(body, request_type) if strict else decode_any(body, request_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return error_for_decode_failure(exc)
    except Exception as exc:  # whatever else a hostile body makes the decoder raise (RecursionError)
        from libs.telemetry.logs import get_logger

        get_logger(__name__).warning("rpc.undecodable_request", error=bounded(repr(exc)))
        return CommandError(code="invalid-request", message=bounded(f"the request cannot be decoded: {exc!r}"))


def claimed_caller(headers: Mapping[str, str] | None) -> str | None:
    """The NATS user the request's token names, unverified (None: no token of ours): whose inbox a reply may
    go to before, or without, the token being checked."""
    try:
        return nats_user_for(bearer_token(headers))
    except AuthError:
        return None


def count_refused_reply(destination: str) -> None:
    """Count one request refused for its reply subject (`trainyard.requests.reply_refused`); rare, so the
    instrument is looked up each time."""
    from libs.telemetry.metrics import REPLIES_REFUSED, attributes, counter

    counter(REPLIES_REFUSED).add(1, attributes(REPLIES_REFUSED, destination))


# The code a refused reply subject is recorded with (span and request duration); no reply carries it.
REPLY_REFUSED = "reply-refused"


def _error_for_decode_failure(exc: msgspec.ValidationError | msgspec.DecodeError) -> CommandError:
    if isinstance(exc, msgspec.ValidationError):
        error = field_error_from_msgspec(exc)
        if error.field.startswith("spec."):
            error = msgspec.structs.replace(error, field=error.field.removeprefix("spec."))
            return CommandError(code="invalid-spec", message=f"the job spec is invalid: {error}",
                                errors=[error])
        return CommandError(code="invalid-request", message=str(error), errors=[error])
    return CommandError(code="invalid-request", message=f"the request is not valid JSON: {exc}")


def register_responder(broker: NatsBroker, service: str, subject: str, request_type: object,
                       handler: RequestHandler, *, queue: str | None = None) -> None:
    """Answer requests on `subject` from anyone who can publish there (node agents, other services);
    several instances share the load through `queue`."""
    _register(broker, service, subject, request_type, lambda request, _: handler(request), None, queue)


def register_with_headers(broker: NatsBroker, service: str, subject: str, request_type: object,
                          handler: Callable[[Any, Mapping[str, str] | None], Awaitable[Any]], *,
                          queue: str | None = None) -> None:
    """Answer requests whose handler checks a credential in the message's headers itself (node agents)."""
    _register(broker, service, subject, request_type, handler, None, queue)


def register_authenticated(broker: NatsBroker, service: str, subject: str, request_type: object,
                           handler: AuthenticatedHandler, *, secret: str, queue: str | None = None) -> None:
    """Answer requests that carry a valid token (libs.auth), up to REQUEST_WORKERS at once; the handler gets
    the caller's identity. A request without one is refused with `unauthenticated` before it is decoded."""
    _register(broker, service, subject, request_type, handler, secret, queue, workers=REQUEST_WORKERS)


def register_all_authenticated(broker: NatsBroker, service: str,
                               handlers: list[tuple[str, object, AuthenticatedHandler]], *, secret: str) -> None:
    """`register_authenticated` for each (subject, request type, handler)."""
    for subject, request_type, handler in handlers:
        register_authenticated(broker, service, subject, request_type, handler, secret=secret)


def _register(broker: NatsBroker, service: str, subject: str, request_type: object,
              handler: Callable[[Any, Any], Awaitable[Any]], secret: str | None,
              queue: str | None, *, workers: int = 1) -> None:
    from opentelemetry.trace import Span, SpanKind

    from libs.eventstore.store import EventTooLarge
    from libs.telemetry.logs import get_logger
    from libs.telemetry.metrics import REQUEST_DURATION, attributes, histogram

    log = get_logger(__name__)
    span_tracer = tracer(f"trainyard.{service}")
    durations = histogram(REQUEST_DURATION)
    span_attributes = messaging_attributes(subject, "process")

    # The handler takes the message whole (`subscribe_whole`).
    async def respond(msg: Any) -> bytes:
        began = time.perf_counter()
        with span_tracer.start_as_current_span(f"process {subject}", context=context_from_headers(msg.headers),
                                               kind=SpanKind.SERVER, attributes=span_attributes) as span:
            body, error = await answer(msg, span)
            if error:
                span.set_attribute("error.type", error)
        durations.record(time.perf_counter() - began, attributes(REQUEST_DURATION, "nats", subject, error))
        return body

    def refuse_reply(msg: Any, caller: str | None, reason: str) -> tuple[bytes, str]:
        """Answer nothing: faststream sends the handler's return to `reply_to`, so it is cleared."""
        log.warning("rpc.reply_refused", subject=subject, caller=caller or "unknown", reply_to=bounded(msg.reply_to),
                    reason=reason)
        count_refused_reply(subject)
        msg.reply_to = ""
        return b"", REPLY_REFUSED

    async def answer(msg: Any, span: Span) -> tuple[bytes, str]:
        """The reply's body, and the code of the error it tells of (empty for none)."""
        identity: Identity | None = None
        caller = claimed_caller(msg.headers)
        unauthenticated: AuthError | None = None
        if secret is not None:
            try:
                identity = identity_from_headers(secret, msg.headers)
                caller = user_nats_name(identity.user)
            except AuthError as exc:
                unauthenticated = exc
        if msg.reply_to and (refused := reply_refusal(caller, msg.reply_to)) is not None:
            return refuse_reply(msg, caller, refused)
        if unauthenticated is not None:
            return encode(CommandError(code="unauthenticated", message=str(unauthenticated))), "unauthenticated"
        if identity is not None:
            span.set_attribute("enduser.id", identity.user)
        request = decode_request(msg.body, request_type)
        if isinstance(request, CommandError):
            return encode(request), request.code
        reply_to = msg.reply_to

        async def progress(update: msgspec.Struct) -> None:
            if reply_to:
                await broker.publish(encode(update), reply_to)

        _progress.set(progress)
        try:
            # without a secret the handler gets the headers (register_with_headers) or ignores them
            reply = await handler(request, identity if secret is not None else msg.headers)
        except SpecError as exc:
            reply = CommandError(code="invalid-spec", message=f"the job spec is invalid: {exc}",
                                 errors=exc.errors)
        except EventTooLarge as exc:
            log.warning("rpc.event_too_large", subject=subject, error=str(exc))
            reply = CommandError(code="invalid-request", message=f"the request was not recorded: {exc}",
                                 hint="shorten the longest fields of the request; nothing was changed")
        except OUTAGES as exc:  # nothing was done: the caller may try again once it passes
            log.warning("rpc.outage", subject=subject, error=bounded(repr(exc)))
            reply = CommandError(code="unavailable", hint="try again in a few seconds",
                                 message=f"the {service} cannot reach its database or NATS right now: {exc!r:.200}")
        except Exception as exc:
            log.exception("rpc.handler_failed", subject=subject)
            span.record_exception(exc)
            reply = CommandError(code="internal", message=bounded(f"{service} failed: {exc}"),
                                 hint=f"see the {service} log for details")
        body = encode(reply)
        if len(body) > MAX_REPLY_BYTES:
            log.error("rpc.reply_too_large", subject=subject, size=len(body))
            reply = CommandError(code="internal", message=f"the reply of {len(body)} bytes is over the limit of "
                                 f"{MAX_REPLY_BYTES}", hint="ask for less at once (fewer jobs, a shorter range)")
            body = encode(reply)
        return body, reply.code if isinstance(reply, CommandError) else ""

    # The body is decoded above, as its contract type, and only there: faststream's own JSON decoding
    # of every body would raise on a deeply nested one before `respond` could refuse it.
    subscribe_whole(broker, subject, respond, queue=queue or f"trainyard-{service}", workers=workers)


def subscribe_whole(broker: NatsBroker, subject: str, handler: Callable[[Any], Awaitable[Any]], *, queue: str,
                    workers: int = 1) -> None:
    """Subscribe `handler` to `subject`, handing it each message whole (body, headers, reply subject) as its
    decoder: a message faststream injects by annotation is looked up in a worker thread for every message,
    and faststream's own decoding of the body is skipped (the handler decodes it as its contract type)."""
    from faststream.nats.annotations import NatsMessage

    async def whole(msg: NatsMessage) -> NatsMessage:
        return msg

    whole.__annotations__["msg"] = NatsMessage
    broker.subscriber(subject, queue=queue, decoder=whole, max_workers=workers)(handler)


# A request nobody was subscribed to is asked again after these pauses before "nothing answers": a
# service's subscription reaches the other servers of a NATS cluster a moment after it is made, and a
# service restarting or taking over from another is away for a moment. Nothing was delivered, so asking
# again can never act twice.
NO_RESPONDER_PAUSES = (0.05, 0.2, 0.5)


async def _request(nc: Client, subject: str, body: bytes, timeout: float, headers: dict[str, str]) -> Any:
    for pause in NO_RESPONDER_PAUSES:
        try:
            return await nc.request(subject, body, timeout=timeout, headers=headers)
        except NoRespondersError:
            await asyncio.sleep(pause)
    return await nc.request(subject, body, timeout=timeout, headers=headers)


async def call_with_progress(nc: Client, subject: str, request: msgspec.Struct, *, idle_timeout: float,
                             token: str | None, progress_type: type[msgspec.Struct],
                             on_progress: Callable[[Any], None]) -> Any:
    """`call` for a request whose handler reports progress (`progress_reporter`): each `progress_type` message is
    handed to `on_progress` until the reply comes. It gives up when nothing came for `idle_timeout` seconds."""
    body = encode(request)
    headers = {**current_trace_headers(), **bearer_headers(token)}
    inbox = nc.new_inbox()
    try:
        sub = await nc.subscribe(inbox)
        await nc.publish(subject, body, reply=inbox, headers=headers)
    except ConnectionClosedError:
        raise ServiceUnavailable(f"the connection to NATS is closed; nothing was sent on {subject}") from None
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout)
            except NatsTimeout:
                raise ServiceUnavailable(f"no answer on {subject} within {idle_timeout:g}s") from None
            if msg.headers and msg.headers.get("Status") == "503":  # nothing is subscribed to the subject
                raise ServiceUnavailable(f"nothing answers on {subject}")
            reply = decode_any(msg.data, Reply)
            if isinstance(reply, progress_type):
                on_progress(reply)
                continue
            return reply
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


class ServiceUnavailable(Exception):
    """No service answered; the stack is probably not running."""


async def call(nc: Client, subject: str, request: msgspec.Struct, *, timeout: float = 10.0,
               reply_type: object = Reply, token: str | None = None, signer: ControlSigner | None = None) -> Any:
    """Send `request` (with the caller's token, if any; signed by `signer`, a service's request to an agent)
    and return the decoded reply (a CommandError is returned, not raised)."""
    body = encode(request)
    headers = {**current_trace_headers(), **bearer_headers(token)}
    if signer is not None:
        headers.update(signer.headers(subject, body, time.time()))
    try:
        msg = await _request(nc, subject, body, timeout, headers)
    except NoRespondersError:
        raise ServiceUnavailable(f"nothing answers on {subject}") from None
    except NatsTimeout:
        raise ServiceUnavailable(f"no answer on {subject} within {timeout:g}s") from None
    except ConnectionClosedError:  # a client's connection gives up after a few reconnects
        raise ServiceUnavailable(f"the connection to NATS is closed; nothing was sent on {subject}") from None
    return decode_any(msg.data, reply_type)
