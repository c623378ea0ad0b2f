"""Request/reply over core NATS with typed messages: serving a service's operations (faststream) and calling.

A service serves its routes (an operation of the catalogue and its handler) with `serve_operations`: each
request is answered by libs/messaging/responder.py, the one responder services and agents share. Callers send
a request with `call` (or `call_with_progress` for one that reports progress) and get the decoded reply; people's
operations go through `call_operation` (the client and the gateway), which picks between them and the time to wait.

Callers (the CLI among them) import this module for calling alone, so faststream is imported by the functions
that serve operations, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from libs.auth import bearer_headers
from libs.contracts.codec import decode_any, encode
from libs.contracts.operations.base import CommandError, Operation
from libs.contracts.operations.catalogue import PEOPLE_REPLIES as Reply
from libs.natsroles import queue_group
from libs.telemetry.tracing import current_trace_headers

if TYPE_CHECKING:
    from faststream.nats import NatsBroker

    from libs.controlsign import ControlSigner
    from libs.messaging.responder import Handler, Responder, Route

# People's requests one service process answers at once: a command waiting for its append (with others, in
# one transaction) must not hold up the requests behind it. Each handler takes the service's lock itself for
# what it changes.
REQUEST_WORKERS = 64


def serve_operations(broker: NatsBroker, service: str, routes: Sequence[Route], *, secret: str | None = None,
                     queue: str | None = None) -> None:
    """Answer each route's operation on its subject through `Responder` (faststream subscribers, in the
    service's queue group so that several instances share the load). Only the service that the catalogue says
    answers an operation may serve it."""
    from libs.messaging.responder import Responder

    responder = Responder(service, secret=secret)
    for operation, handler in routes:
        if operation.answered_by != service:
            raise ValueError(f"the {service} cannot answer {operation.name}: the catalogue has the "
                             f"{operation.answered_by} answer it")
        workers = REQUEST_WORKERS if operation.authentication == "user-token" else 1
        _serve(broker, responder, operation, handler, queue or queue_group(service), workers)


def _serve(broker: NatsBroker, responder: Responder, operation: Operation[Any, Any], handler: Handler, queue: str,
           workers: int) -> None:
    from opentelemetry.trace import use_span

    from libs.messaging.responder import REPLY_REFUSED, Incoming, Later

    async def respond(msg: Any) -> bytes:
        began = time.perf_counter()
        incoming = Incoming(subject=operation.subject, body=msg.body, headers=msg.headers, reply_to=msg.reply_to)
        span = responder.start_span(incoming)
        with use_span(span, end_on_exit=True):
            reply_to = msg.reply_to

            async def progress(update: msgspec.Struct) -> None:
                if reply_to:
                    await broker.publish(encode(update), reply_to)

            answer = await responder.answer(operation, handler, incoming, span, progress=progress)
            if answer is None:  # refused for its reply subject: faststream sends the return to `reply_to`
                msg.reply_to = ""
                responder.finished(incoming, span, began, REPLY_REFUSED)
                return b""
            assert not isinstance(answer, Later), "services answer at once"
            body, error = responder.reply_body(operation, answer)
            responder.finished(incoming, span, began, error, getattr(answer, "message", ""))
            return body

    # The body is decoded by the responder, as its contract type, and only there: faststream's own JSON
    # decoding of every body would raise on a deeply nested one before `respond` could refuse it.
    subscribe_whole(broker, operation.subject, respond, queue=queue, workers=workers)


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


# How long people's requests may take beyond the caller's usual timeout: a view of a past instant may replay a long
# history first; a request that reports its progress (a what-if) may run long, and is given up only after this long
# without a word.
PAST_TIMEOUT = 120.0
PROGRESS_IDLE_TIMEOUT = 120.0


async def call_operation(nc: Client, operation: Operation[Any, Any], request: msgspec.Struct, *, token: str | None,
                         timeout: float = 10.0, on_progress: Callable[[Any], None] | None = None) -> Any:
    """Send `request` as people's `operation` with `token` and return its reply (its reply type, or the
    `CommandError` that refused it): the one way the client and the gateway ask."""
    if operation.progress is not None:
        return await call_with_progress(nc, operation.subject, request, token=token,
                                        idle_timeout=max(timeout, PROGRESS_IDLE_TIMEOUT),
                                        progress_type=operation.progress, on_progress=on_progress or (lambda _: None))
    if getattr(request, "at", None) is not None:
        timeout = max(timeout, PAST_TIMEOUT)
    return await call(nc, operation.subject, request, timeout=timeout, token=token,
                      reply_type=operation.reply | CommandError)


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
    except ConnectionClosedError:  # closed (by its owner, or by an expired token it cannot log in with again)
        raise ServiceUnavailable(f"the connection to NATS is closed; nothing was sent on {subject}") from None
    return decode_any(msg.data, reply_type)
