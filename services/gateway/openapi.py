"""The HTTP API's OpenAPI 3.1 document, made from the operation catalogue and its msgspec types.

Every operation people send is `POST /api/v1/<operation name>` with its request as the JSON body and its
reply as the answer; a refusal is a problem-details body (RFC 9457, `problems.py`). The schemas are msgspec's
JSON Schemas of the same types the services decode, so the document cannot drift from what they accept.
"""

from __future__ import annotations

from typing import Any

import msgspec

from libs.contracts.operations.base import Operation
from libs.contracts.operations.catalogue import sent_by

API_PREFIX = "/api/v1"
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


def operation_path(operation: Operation[Any, Any]) -> str:
    return f"{API_PREFIX}/{operation.name}"


def openapi_document() -> dict[str, Any]:
    """The whole document: a path per operation, the schemas they use, bearer authentication."""
    operations = sent_by("user")
    types = sorted({kind for operation in operations for kind in (operation.request, operation.reply)},
                   key=lambda kind: kind.__name__)
    _, components = msgspec.json.schema_components(types, ref_template=REF)
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
    return {
        "openapi": "3.1.0",
        "info": {"title": "Trainyard", "version": "1",
                 "description": "Every operation people send, as JSON over HTTP, acting as the token's user."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"token": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}},
        "security": [{"token": []}],
    }
