"""The gateway's requests in traces: one server span each, named by the route's template (never the path, which
has no bound), with its status; and the follow streams and terminals counted while they are open."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.gateway.telemetry import RequestTelemetry


async def test_each_request_is_a_server_span_named_by_its_route_template() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    open_now: Counter[str] = Counter()
    seen_open: list[int] = []

    async def job(request: Request) -> Response:
        return PlainTextResponse(request.path_params["job_id"], status_code=200)

    async def follow(_: Request) -> Response:
        seen_open.append(open_now["streams"])
        return PlainTextResponse("", status_code=404)

    app = Starlette(routes=[Route("/jobs/{job_id}", job), Route("/api/v1/follow/logs", follow)],
                    middleware=[Middleware(RequestTelemetry, open_now=open_now, spans=provider.get_tracer("t"))])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        assert (await client.get("/jobs/job-1234")).status_code == 200
        assert (await client.get("/api/v1/follow/logs")).status_code == 404
        assert (await client.get("/no/such/page/job-99")).status_code == 404
    await asyncio.sleep(0)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"GET /jobs/{job_id}", "GET /api/v1/follow/logs", "GET unmatched"}
    shown = spans["GET /jobs/{job_id}"]
    assert shown.kind == SpanKind.SERVER and shown.attributes is not None
    assert shown.attributes["http.route"] == "/jobs/{job_id}" and shown.attributes["http.response.status_code"] == 200
    assert spans["GET unmatched"].attributes["http.response.status_code"] == 404  # type: ignore[index]
    assert seen_open == [1] and open_now["streams"] == 0
