"""The gateway's OpenAPI document: valid OpenAPI 3.1, an operation for each one people may send and a GET for each
follow stream, and schemas of the very types the services decode."""

from __future__ import annotations

from openapi_spec_validator import validate

from libs.contracts.operations.base import CommandError
from libs.contracts.operations.catalogue import sent_by
from services.gateway.openapi import FOLLOW_ENDPOINTS, openapi_document, operation_path
from services.gateway.problems import problem


def test_the_document_is_valid_openapi_with_every_peoples_operation() -> None:
    document = openapi_document()
    validate(document)  # raises on an invalid document
    assert set(document["paths"]) == ({operation_path(operation) for operation in sent_by("user")}
                                      | {endpoint.path for endpoint in FOLLOW_ENDPOINTS})
    submit = document["paths"]["/api/v1/submit-job"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SubmitJob"}
    assert "spec" in document["components"]["schemas"]["SubmitJob"]["properties"]


def test_each_follow_stream_is_a_get_of_server_sent_events_with_its_query_parameters() -> None:
    paths = openapi_document()["paths"]
    logs = paths["/api/v1/follow/logs"]
    assert set(logs) == {"get"}
    assert set(logs["get"]["responses"]["200"]["content"]) == {"text/event-stream"}
    parameters = {(parameter["in"], parameter["name"]): parameter for parameter in logs["get"]["parameters"]}
    assert set(parameters) == {("query", "job_id"), ("query", "rank"), ("header", "Last-Event-ID")}
    assert parameters["query", "job_id"]["required"] and not parameters["query", "rank"]["required"]
    assert parameters["query", "rank"]["schema"] == {"type": "integer", "minimum": 0}
    metrics = {parameter["name"]: parameter["required"]
               for parameter in paths["/api/v1/follow/metrics"]["get"]["parameters"]}
    assert metrics == {"job_id": True, "name": True, "rank": False, "Last-Event-ID": False}
    status = paths["/api/v1/follow/status"]["get"]["parameters"]
    assert [parameter["name"] for parameter in status] == ["job_id"]  # nothing to resume: each event is the whole view
    assert [parameter["name"] for parameter in paths["/api/v1/follow/alerts"]["get"]["parameters"]] == ["Last-Event-ID"]


def test_a_refusal_is_a_problem_with_the_status_of_its_kind() -> None:
    status, body = problem(CommandError(code="forbidden", message="read-only", hint="ask its creator"), instance="/x")
    assert status == 403
    assert body == {"type": "urn:trainyard:problem:forbidden", "title": "Not allowed", "status": 403,
                    "detail": "read-only", "code": "forbidden", "hint": "ask its creator", "instance": "/x"}
