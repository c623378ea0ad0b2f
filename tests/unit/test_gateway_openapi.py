"""The gateway's OpenAPI document: valid OpenAPI 3.1, an operation for each one people may send, and schemas of
the very types the services decode."""

from __future__ import annotations

from openapi_spec_validator import validate

from libs.contracts.operations.base import CommandError
from libs.contracts.operations.catalogue import sent_by
from services.gateway.openapi import openapi_document, operation_path
from services.gateway.problems import problem


def test_the_document_is_valid_openapi_with_every_peoples_operation() -> None:
    document = openapi_document()
    validate(document)  # raises on an invalid document
    assert set(document["paths"]) == {operation_path(operation) for operation in sent_by("user")}
    submit = document["paths"]["/api/v1/submit-job"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SubmitJob"}
    assert "spec" in document["components"]["schemas"]["SubmitJob"]["properties"]


def test_a_refusal_is_a_problem_with_the_status_of_its_kind() -> None:
    status, body = problem(CommandError(code="forbidden", message="read-only", hint="ask its creator"), instance="/x")
    assert status == 403
    assert body == {"type": "urn:trainyard:problem:forbidden", "title": "Not allowed", "status": 403,
                    "detail": "read-only", "code": "forbidden", "hint": "ask its creator", "instance": "/x"}
