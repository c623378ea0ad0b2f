"""The console's sign-in and jobs page against a real scheduler on real NATS and PostgreSQL: a person signs in
with their token, sees their jobs in a table they can search and page, and stops, re-prioritises and deletes
them through the row menu's dialogs and the batch delete; what their access does not allow is neither offered
nor done when forced; a change without the session's CSRF token changes nothing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from html import unescape
from pathlib import Path

import httpx
import pytest_asyncio

from client.api import TrainyardClient
from libs.contracts.ids import new_job_id
from services.gateway.app import build_app
from services.gateway.connections import UserConnections
from services.gateway.console import links
from services.gateway.console.signin import SignIn
from services.gateway.sessions import SESSION_COOKIE, Sessions
from tests.support.schedulers import Schedulers, spec, token

ORIGIN = {"Origin": "http://gateway"}


class Browser:
    """An HTTP client that keeps cookies as a browser does, signed in by posting a token to /signin."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def sign_in(self, user_token: str) -> httpx.Response:
        return await self.client.post("/signin", data={"token": user_token, "next": "/jobs"}, headers=ORIGIN)

    async def csrf(self) -> str:
        page = await self.client.get("/jobs")
        found = re.search(r'name="csrf-token" content="([^"]+)"', page.text)
        assert found, page.text[:500]
        return found.group(1)

    async def post_form(self, path: str, fields: dict[str, str | list[str]], *, csrf: bool = True) -> httpx.Response:
        data = dict(fields)
        if csrf:
            data["csrf_token"] = await self.csrf()
        return await self.client.post(path, data=data, headers=ORIGIN)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str, schedulers: Schedulers, tmp_path: Path) -> AsyncIterator[tuple[Sessions, Path]]:
    await schedulers.start()
    yield Sessions(), tmp_path / "links"


async def browser_for(nats_url: str, sessions: Sessions, links_at: Path) -> tuple[Browser, UserConnections]:
    connections = UserConnections(nats_url)
    app = build_app(connections, sessions)
    for route in app.router.routes:  # the one-time links of this test's folder
        endpoint = getattr(route, "endpoint", None)
        owner = getattr(endpoint, "__self__", None)
        if isinstance(owner, SignIn):
            owner.links_at = links_at
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return Browser(client), connections


async def submitted(nats_url: str, user_token: str, name: str, **changes: object) -> str:
    async with TrainyardClient.connect(nats_url, token=user_token) as client:
        accepted = await client.submit(spec(name, **changes), job_id=new_job_id())
        return accepted.job_id


def table_names(html: str) -> list[str]:
    return [unescape(name) for name in re.findall(r'class="job-name">([^<]*)</a>', html)]


async def test_a_person_signs_in_with_a_token_and_sees_their_jobs(
        nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    alice = token("alice")
    await submitted(nats_url, alice, name="first-job")
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        before = await browser.client.get("/jobs")
        assert before.status_code == 303 and before.headers["location"].startswith("/signin")

        refused = await browser.sign_in("not-a-token")
        assert refused.status_code == 401 and "not a Trainyard token" in refused.text
        oversized = await browser.client.post("/signin", data={"token": "x" * 70_000}, headers=ORIGIN)
        assert oversized.status_code == 400 and "over the limit" in oversized.text

        signed_in = await browser.sign_in(alice)
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/jobs"
        cookie = signed_in.headers["set-cookie"]
        assert SESSION_COOKIE in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert alice not in cookie  # the browser holds a session id, never the token

        page = await browser.client.get("/jobs")
        assert page.status_code == 200
        assert table_names(page.text) == ["first-job"]
        assert "Queued" in page.text and "alice" in page.text
        headers = page.headers
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "same-origin"
        assert headers["cache-control"] == "no-store"

        chinese = await browser.client.get("/jobs", headers={"Accept-Language": "zh-CN,zh;q=0.9,en;q=0.5"})
        assert "任务式训练" in chinese.text and "排队中" in chinese.text and "操作" in chinese.text

        out = await browser.post_form("/signout", {})
        assert out.status_code == 303
        after = await browser.client.get("/jobs")
        assert after.status_code == 303 and len(sessions) == 0
    finally:
        await browser.client.aclose()
        await connections.close()


async def test_search_filters_and_pages_of_fifty(nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    bob = token("bob")
    for number in range(55):
        await submitted(nats_url, bob, name=f"sweep-{number:02d}")
    await submitted(nats_url, bob, name="lonely")
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        await browser.sign_in(bob)
        first = await browser.client.get("/jobs")
        assert len(table_names(first.text)) == 50 and "56 jobs" in first.text and "Page 1 of 2" in first.text
        second = await browser.client.get("/jobs?page=2")
        names = table_names(first.text) + table_names(second.text)
        assert sorted(names) == sorted([f"sweep-{n:02d}" for n in range(55)] + ["lonely"])

        searched = await browser.client.get("/jobs", params={"field": "name", "value": "lone"})
        assert table_names(searched.text) == ["lonely"]
        by_status = await browser.client.get("/jobs", params={"status": "running"})
        assert table_names(by_status.text) == []
    finally:
        await browser.client.aclose()
        await connections.close()


async def test_row_dialogs_stop_prioritise_and_delete(nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    carol = token("carol")
    job_id = await submitted(nats_url, carol, name="to-stop")
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        await browser.sign_in(carol)
        dialog = await browser.client.get(f"/jobs/{job_id}/priority")
        assert dialog.status_code == 200 and 'value="urgent"' in dialog.text
        assert 'value="very-urgent"' not in dialog.text  # administrators only

        forced = await browser.post_form(f"/jobs/{job_id}/priority", {"priority": "very-urgent"})
        assert forced.status_code == 403 and 'id="action-error"' in forced.text

        changed = await browser.post_form(f"/jobs/{job_id}/priority", {"priority": "urgent"})
        assert changed.status_code == 303
        assert "Urgent" in (await browser.client.get("/jobs")).text

        no_csrf = await browser.post_form(f"/jobs/{job_id}/stop", {}, csrf=False)
        assert no_csrf.status_code == 403
        assert "Queued" in (await browser.client.get("/jobs")).text

        stopped = await browser.post_form(f"/jobs/{job_id}/stop", {})
        assert stopped.status_code == 303 and stopped.headers["location"] == "/jobs?done=stopped"
        listed = await browser.client.get("/jobs?done=stopped")
        assert "Stopped" in listed.text and 'id="notice"' in listed.text

        confirm = await browser.post_form("/jobs/delete", {"job_id": [job_id]})
        assert confirm.status_code == 200 and 'id="confirm-delete"' in confirm.text
        deleted = await browser.post_form("/jobs/delete", {"job_id": [job_id], "confirmed": "yes"})
        assert deleted.status_code == 303
        assert table_names((await browser.client.get("/jobs")).text) == []
    finally:
        await browser.client.aclose()
        await connections.close()


async def test_a_read_only_colleague_is_offered_no_stop_and_is_refused_when_forcing_it(
        nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    job_id = await submitted(nats_url, token("dave", "vision"), name="shared", project="vision", access="read-only")
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        await browser.sign_in(token("erin", "vision"))
        page = await browser.client.get("/jobs")
        assert table_names(page.text) == ["shared"]
        assert f"/jobs/{job_id}/stop" not in page.text and f"/jobs/new?clone={job_id}" in page.text
        forced = await browser.post_form(f"/jobs/{job_id}/stop", {})
        assert forced.status_code == 403 and 'id="refusal"' in forced.text
        async with TrainyardClient.connect(nats_url, token=token("dave", "vision")) as client:
            assert (await client.get_job(job_id)).job.status == "queued"
    finally:
        await browser.client.aclose()
        await connections.close()


async def test_a_job_name_with_markup_is_shown_as_text(nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    frank = token("frank")
    await submitted(nats_url, frank, name="<script>alert(1)</script>")
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        await browser.sign_in(frank)
        page = await browser.client.get("/jobs")
        assert "<script>alert(1)</script>" not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    finally:
        await browser.client.aclose()
        await connections.close()


async def test_a_one_time_link_signs_in_once(nats_url: str, gateway: tuple[Sessions, Path]) -> None:
    sessions, links_at = gateway
    code = links.issue(links_at, token("root", admin=True))
    browser, connections = await browser_for(nats_url, sessions, links_at)
    try:
        first = await browser.client.post("/signin/link", json={"code": code}, headers=ORIGIN)
        assert first.status_code == 200 and first.json() == {"next": "/jobs"}
        assert (await browser.client.get("/jobs")).status_code == 200
        browser.client.cookies.clear()
        again = await browser.client.post("/signin/link", json={"code": code}, headers=ORIGIN)
        assert again.status_code == 401 and "used up" in again.json()["error"]
        assert list(links_at.iterdir()) == []
    finally:
        await browser.client.aclose()
        await connections.close()
