"""The gateway's requests as the other processes' are seen: a server span for each (its context rides on every
NATS request the gateway then sends, so a job's trace starts at the HTTP request that submitted it), and how long
each took by route template and status (`http.server.request.duration`); also how many follow streams and
terminals are open now. Pure ASGI, so that streamed answers pass through unbuffered.
"""

from __future__ import annotations

import time
from collections import Counter

from opentelemetry.trace import SpanKind, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.telemetry.metrics import HTTP_DURATION, attributes, histogram
from libs.telemetry.tracing import tracer

FOLLOW_PREFIX = "/api/v1/follow/"
UNMATCHED = "unmatched"  # a path no route serves: never the path itself, which has no bound


class RequestTelemetry:
    def __init__(self, app: ASGIApp, open_now: Counter[str], spans: Tracer | None = None) -> None:
        self.app = app
        self.open = open_now  # "streams", "terminals": how many are open now (the service samples it)
        self.tracer = spans if spans is not None else tracer("trainyard.gateway")
        self.duration = histogram(HTTP_DURATION)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        method = "GET" if websocket else str(scope.get("method", ""))
        path = str(scope.get("path", ""))
        kind = "terminals" if websocket else "streams" if path.startswith(FOLLOW_PREFIX) else None
        status = 101 if websocket else 500  # what it was if the app fails before it answers

        async def answering(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "websocket.close" and int(message.get("code", 1000)) >= 4000:
                status = int(message["code"]) - 4000  # the terminal's refusals: 4000 + the HTTP status
            await send(message)

        started = time.perf_counter()
        if kind is not None:
            self.open[kind] += 1
        with self.tracer.start_as_current_span(method, kind=SpanKind.SERVER,
                                               attributes={"http.request.method": method, "url.path": path}) as span:
            try:
                await self.app(scope, receive, answering)
            finally:
                if kind is not None:
                    self.open[kind] -= 1
                route = getattr(scope.get("route"), "path", None) or UNMATCHED
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                self.duration.record(time.perf_counter() - started,
                                     attributes(HTTP_DURATION, method, route, str(status)))
