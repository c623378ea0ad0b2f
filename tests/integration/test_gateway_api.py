"""The HTTP API: each operation people send, over HTTP, against a real scheduler on real NATS and PostgreSQL,
acting as the caller's token; refusals as problem details naming the field as the CLI does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest_asyncio

from libs.contracts.ids import new_job_id
from services.gateway.app import build_app
from services.gateway.connections import UserConnections
from tests.support.schedulers import Schedulers, spec, token

PROBLEM = "application/problem+json"


@pytest_asyncio.fixture(loop_scope="session")
async def http(nats_url: str, schedulers: Schedulers) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's API in the test's process, a scheduler behind it."""
    await schedulers.start()
    connections = UserConnections(nats_url)
    transport = httpx.ASGITransport(app=build_app(connections))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client
    await connections.close()


def as_user(user: str, *projects: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(user, *projects)}"}


def submission(**changes: Any) -> dict[str, Any]:
    return {"job_id": new_job_id(), "spec": msgspec.to_builtins(spec(**changes))}


async def test_a_job_submitted_over_http_is_listed_and_shown_to_its_creator(http: httpx.AsyncClient) -> None:
    request = submission(name="over-http")
    accepted = await http.post("/api/v1/submit-job", json=request, headers=as_user("alice"))
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["job_id"] == request["job_id"]

    listed = await http.post("/api/v1/list-jobs", json={}, headers=as_user("alice"))
    assert [job["name"] for job in listed.json()["jobs"]] == ["over-http"]
    shown = await http.post("/api/v1/get-job", json={"job_id": request["job_id"]}, headers=as_user("alice"))
    assert shown.json()["job"]["status"] == "queued"


async def test_another_users_job_is_not_found_as_the_cli_would_say(http: httpx.AsyncClient) -> None:
    request = submission()
    await http.post("/api/v1/submit-job", json=request, headers=as_user("alice"))
    seen = await http.post("/api/v1/get-job", json={"job_id": request["job_id"]}, headers=as_user("bob", "other"))
    assert seen.status_code == 404
    assert seen.headers["content-type"] == PROBLEM
    assert seen.json()["code"] == "not-found"


async def test_a_request_without_a_token_is_refused_before_anything_is_sent(http: httpx.AsyncClient) -> None:
    refused = await http.post("/api/v1/submit-job", json=submission())
    assert refused.status_code == 401
    assert refused.json()["code"] == "unauthenticated" and "Bearer" in refused.json()["hint"]
    garbage = await http.post("/api/v1/list-jobs", json={}, headers={"Authorization": "Bearer not-a-token"})
    assert garbage.status_code == 401 and garbage.json()["detail"] == "the token is not a Trainyard token"
    listed = await http.post("/api/v1/list-jobs", json={}, headers=as_user("alice"))
    assert listed.json()["jobs"] == []


async def test_a_bad_field_is_named_as_the_cli_names_it(http: httpx.AsyncClient) -> None:
    request = submission()
    request["spec"]["nodes"] = "two"
    refused = await http.post("/api/v1/submit-job", json=request, headers=as_user("alice"))
    assert refused.status_code == 422
    body = refused.json()
    assert body["code"] == "invalid-spec" and body["errors"][0]["field"] == "nodes"
    assert body["type"] == "urn:trainyard:problem:invalid-spec" and body["instance"] == "/api/v1/submit-job"

    unknown = await http.post("/api/v1/list-jobs", json={"colour": "red"}, headers=as_user("alice"))
    assert unknown.status_code == 400 and "colour" in unknown.json()["detail"]


async def test_what_is_no_operation_or_too_large_is_refused(http: httpx.AsyncClient) -> None:
    missing = await http.post("/api/v1/drop-tables", json={}, headers=as_user("alice"))
    assert missing.status_code == 404 and "openapi.json" in missing.json()["hint"]
    agents_only = await http.post("/api/v1/start-process", json={}, headers=as_user("alice"))
    assert agents_only.status_code == 404
    huge = await http.post("/api/v1/list-jobs", content=b"{" + b" " * (1024 * 1024 + 1) + b"}",
                           headers=as_user("alice"))
    assert huge.status_code == 400 and "over the limit" in huge.json()["detail"]


async def test_the_openapi_document_is_served(http: httpx.AsyncClient) -> None:
    document = await http.get("/api/v1/openapi.json")
    assert document.status_code == 200
    assert "/api/v1/submit-job" in document.json()["paths"]


async def test_a_held_connection_outlives_its_idle_time_and_is_closed_after(nats_url: str,
                                                                              schedulers: Schedulers) -> None:
    """A terminal's session lives on its user's connection: idle or not, it stays open while held."""
    await schedulers.start()
    connections = UserConnections(nats_url, idle_seconds=0)
    try:
        async with connections.held(token("alice")) as nc:
            await connections.close_idle()
            assert not nc.is_closed
        await connections.close_idle()
        assert nc.is_closed
    finally:
        await connections.close()
