"""The HTTP API's OpenAPI 3.1 document, made from the operation catalogue and its msgspec types.

Every operation people send is `POST /api/v1/<operation name>` with its request as the JSON body and its
reply as the answer; a refusal is a problem-details body (RFC 9457, `problems.py`). The schemas are msgspec's
JSON Schemas of the same types the services decode, so the document cannot drift from what they accept.

The follow streams (`GET /api/v1/follow/<what>`, Server-Sent Events, served by `follow.py`) are declared here too,
with the query parameters each takes and the request type they decode into: the streams take what this says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from libs.contracts.agent import LogChunk
from libs.contracts.events import EventEnvelope
from libs.contracts.operations.alerts import ListAlerts
from libs.contracts.operations.base import Operation
from libs.contracts.operations.catalogue import sent_by
from libs.contracts.operations.jobs import GetJob, GetJobLogs, JobView
from libs.contracts.operations.runs import GetSeries, SeriesPoint
from libs.contracts.patterns import for_json_schema

API_PREFIX = "/api/v1"
FOLLOW_PREFIX = f"{API_PREFIX}/follow"
EVENT_STREAM = "text/event-stream"
REF = "#/components/schemas/{name}"

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A refusal (RFC 9457): `code` is what the CLI prints, `errors` names each field at fault.",
    "properties": {
        "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
        "detail": {"type": "string"}, "code": {"type": "string"}, "hint": {"type": "string"},
        "instance": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object", "properties": {
            "field": {"type": "string"}, "message": {"type": "string"}}}},
    },
    "required": ["type", "title", "status", "detail", "code"],
}


@dataclass(frozen=True)
class QueryParameter:
    name: str
    kind: type[str] | type[int]  # an int is a whole number of digits, nothing else
    description: str


@dataclass(frozen=True)
class FollowEndpoint:
    """A follow stream: the query parameters it takes, the request type they decode into, what it sends."""

    name: str
    summary: str
    request: type[msgspec.Struct]
    parameters: tuple[QueryParameter, ...]
    events: str
    resumable: bool  # its events carry ids, and `Last-Event-ID` goes on after one

    @property
    def path(self) -> str:
        return f"{FOLLOW_PREFIX}/{self.name}"


JOB_ID = QueryParameter("job_id", str, "The job's id.")
FOLLOW_LOGS = FollowEndpoint(
    "logs", "Follow a job's log as it is written.", GetJobLogs,
    (JOB_ID, QueryParameter("rank", int, "Only this rank's log (default: every rank's).")),
    "`event: log` for each chunk of the job's log, in the order they were stored, its data a "
    f"[LogChunk]({REF.format(name='LogChunk')}); once the job has ended and its last chunks are read, `event: end`.",
    resumable=True)
FOLLOW_METRICS = FollowEndpoint(
    "metrics", "Follow one metric series of a job's run.", GetSeries,
    (JOB_ID, QueryParameter("name", str, "The series' name."),
     QueryParameter("rank", int, "Only this rank's points (default: every rank's).")),
    "`event: point` for each point of the series, in the order they were logged, its data a "
    f"[SeriesPoint]({REF.format(name='SeriesPoint')}) as `get-series` gives it; once the job has ended and its last "
    "points are read, `event: end`.",
    resumable=True)
FOLLOW_STATUS = FollowEndpoint(
    "status", "Follow a job's status.", GetJob, (JOB_ID,),
    f"`event: status` with the job's [JobView]({REF.format(name='JobView')}) at once and whenever its status, "
    "reason, attempt or nodes change; once the job has ended, `event: end`.",
    resumable=False)
FOLLOW_ALERTS = FollowEndpoint(
    "alerts", "Follow the alerts you may see.", ListAlerts, (),
    f"`event: alert` for each alert raised that you may see, oldest first, its data an [EventEnvelope]("
    f"{REF.format(name='EventEnvelope')}) whose event is an AlertRaised; it never ends.",
    resumable=True)
FOLLOW_ENDPOINTS = (FOLLOW_LOGS, FOLLOW_METRICS, FOLLOW_STATUS, FOLLOW_ALERTS)
STREAM_NOTES = (
    " A comment line (`: keep-alive`) comes every few seconds, so that proxies keep the stream open. A refusal known "
    "before the stream starts (no token, no such job, too many streams open with the token) is answered as a "
    "problem instead of a stream; one while it streams is `event: error` with the problem as its data, and the "
    "stream closes. `end` and `error` close the stream: an `EventSource` must then be closed, or it connects again.")
RESUMING = ("The `id` of the last event received (an `EventSource` sends it when it connects again): the stream goes "
            "on after that event.")


def operation_path(operation: Operation[Any, Any]) -> str:
    return f"{API_PREFIX}/{operation.name}"


def follow_path_item(endpoint: FollowEndpoint, problem: dict[str, Any]) -> dict[str, Any]:
    """A follow stream as a GET whose answer is `text/event-stream`, with its query parameters."""
    required = {field.name for field in msgspec.structs.fields(endpoint.request) if field.required}
    parameters: list[dict[str, Any]] = [
        {"name": parameter.name, "in": "query", "required": parameter.name in required,
         "description": parameter.description,
         "schema": {"type": "string"} if parameter.kind is str else {"type": "integer", "minimum": 0}}
        for parameter in endpoint.parameters]
    if endpoint.resumable:
        parameters.append({"name": "Last-Event-ID", "in": "header", "required": False, "description": RESUMING,
                           "schema": {"type": "string"}})
    return {"get": {
        "operationId": f"follow-{endpoint.name}",
        "summary": endpoint.summary,
        "description": endpoint.events + STREAM_NOTES,
        "tags": ["follow"],
        "parameters": parameters,
        "responses": {"200": {"description": "Server-Sent Events, until `end` or the caller leaves",
                              "content": {EVENT_STREAM: {"schema": {"type": "string"}}}},
                      "default": problem},
    }}


def openapi_document() -> dict[str, Any]:
    """The whole document: a path per operation and per follow stream, the schemas they use, bearer
    authentication."""
    operations = sent_by("user")
    streamed: set[type[Any]] = {LogChunk, SeriesPoint, JobView, EventEnvelope}  # the data of the follow streams
    types = sorted({kind for operation in operations for kind in (operation.request, operation.reply)} | streamed,
                   key=lambda kind: kind.__name__)
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    components = for_json_schema(components)
    components["Problem"] = PROBLEM_SCHEMA
    problem = {"description": "Refused", "content": {"application/problem+json": {
        "schema": {"$ref": REF.format(name="Problem")}}}}
    paths = {operation_path(operation): {"post": {
        "operationId": operation.name,
        "summary": operation.summary,
        "tags": [operation.answered_by],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(name=operation.request.__name__)}}}},
        "responses": {"200": {"description": "Answered", "content": {"application/json": {
            "schema": {"$ref": REF.format(name=operation.reply.__name__)}}}},
                      "default": problem},
    }} for operation in operations}
    paths.update({endpoint.path: follow_path_item(endpoint, problem) for endpoint in FOLLOW_ENDPOINTS})
    return {
        "openapi": "3.1.0",
        "info": {"title": "Trainyard", "version": "1",
                 "description": "Every operation people send, as JSON over HTTP, acting as the token's user; "
                                "and streams that follow a job's log, metrics and status, and the alerts."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"token": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}},
        "security": [{"token": []}],
    }
