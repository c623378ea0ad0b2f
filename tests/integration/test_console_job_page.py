"""The console's job page (seed 001, 查看任务式训练详情), signed in as different people, against a real scheduler on
real NATS and PostgreSQL: what each may see of a job, in both languages, with whatever the job's author wrote shown
as text; and the page scripts write text only as text."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest_asyncio

from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import DebugTerminal
from services.gateway.app import build_app
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.console.base import Console
from services.gateway.console.i18n import LANGUAGE_COOKIE
from services.gateway.console.job_page import JobPage
from services.gateway.sessions import SESSION_COOKIE, Sessions
from tests.support.schedulers import Schedulers, spec, token

STATIC_CONSOLE = Path(__file__).resolve().parents[2] / "services" / "gateway" / "static" / "console"
HOSTILE = "<script>alert(1)</script>"
# What would read text as markup or code: a page script writes text with textContent only.
MARKUP_SINKS = [re.compile(pattern) for pattern in (r"\binnerHTML\b", r"\bouterHTML\b", r"\binsertAdjacentHTML\b",
                                                     r"\bdocument\.write", r"\beval\s*\(", r"\bnew\s+Function\b")]
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"})


class Texts(HTMLParser):
    """The text inside each element that has an id, and the ids present."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, str | None]] = []
        self.texts: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs).get("id")
        if found:
            self.texts.setdefault(found, "")
        if tag not in VOID:
            self.open.append((tag, found))

    def handle_endtag(self, tag: str) -> None:
        while self.open:
            closed, _ = self.open.pop()
            if closed == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, found in self.open:
            if found:
                self.texts[found] += data


def texts_of(html: str) -> dict[str, str]:
    parser = Texts()
    parser.feed(html)
    return {key: " ".join(value.split()) for key, value in parser.texts.items()}


@dataclass
class Gateway:
    """The gateway's app in the test's process (with the job page), and its console sessions."""

    http: httpx.AsyncClient
    sessions: Sessions

    async def page(self, path: str, user: str, *projects: str, language: str = "en") -> tuple[int, str]:
        """The page as `user` (in `projects`) sees it, signed in to the console: its status and HTML."""
        session_id, _ = self.sessions.open(token(user, *projects),
                                           Identity(user=user, projects=list(projects or ["default"])))
        cookies = f"{SESSION_COOKIE}={session_id}; {LANGUAGE_COOKIE}={language}"
        answer = await self.http.get(path, headers={"cookie": cookies})
        return answer.status_code, answer.text

    async def send(self, operation: str, body: dict[str, Any], user: str = "alice", *projects: str) -> Any:
        answer = await self.http.post(f"/api/v1/{operation}", json=body,
                                      headers={"Authorization": f"Bearer {token(user, *projects)}"})
        assert answer.status_code == 200, answer.text
        return answer.json()

    async def submit(self, user: str, *projects: str, **changes: Any) -> str:
        job_id = new_job_id()
        await self.send("submit-job", {"job_id": job_id, "spec": msgspec.to_builtins(spec(**changes))}, user,
                        *projects)
        return job_id


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str, schedulers: Schedulers) -> AsyncIterator[Gateway]:
    await schedulers.start()
    connections = UserConnections(nats_url)
    sessions = Sessions()
    app = build_app(connections, sessions)
    app.router.routes.extend(JobPage(Console(UserCalls(connections), sessions)).routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield Gateway(http, sessions)
    await connections.close()


async def test_the_creator_sees_the_job_in_both_languages(gateway: Gateway) -> None:
    job_id = await gateway.submit("alice", name="resnet-50")

    status, html = await gateway.page(f"/jobs/{job_id}", "alice")
    assert status == 200, html
    shown = texts_of(html)
    assert "resnet-50" in shown["job"]
    assert 'id="job-status" data-status="queued"' in html and shown["job-status"] == "Queued"
    assert "JobSubmitted" in shown["events"] and "name=resnet-50" in shown["events"]
    # A queued job: why it waits, and the operations its creator may do now (and not what it may not).
    assert "queue" in shown and "devenv" in shown
    actions = re.findall(r'href="([^"]+)"', html[html.index('id="job-actions"'):html.index("</nav>",
                                                                                         html.index('id="job-actions"'))])
    assert actions == [f"/jobs/{job_id}/priority", f"/jobs/new?clone={job_id}", "#devenv",
                       f"/jobs/{job_id}/tensorboard", f"/jobs/{job_id}/stop"]
    assert 'id="logs"' in html and "/static/console/job.js" in html and "/static/vendor/uplot/uPlot.iife.min.js" in html

    status, html = await gateway.page(f"/jobs/{job_id}", "alice", language="zh-CN")
    assert status == 200
    shown = texts_of(html)
    assert shown["job-status"] == "排队中" and "resnet-50" in shown["job"]
    assert "事件" in shown["events-section"] and "JobSubmitted" in shown["events"]
    script_texts = json.loads(re.findall(r'<script type="application/json" id="page-texts">(.*?)</script>', html)[0])
    assert script_texts["status"]["queued"] == "排队中"  # the script's texts, in the page's language


async def test_a_stopped_jobs_history_and_operations(gateway: Gateway) -> None:
    job_id = await gateway.submit("alice", name="short-lived")
    await gateway.send("stop-jobs", {"job_ids": [job_id]})

    status, html = await gateway.page(f"/jobs/{job_id}", "alice")
    assert status == 200
    shown = texts_of(html)
    assert 'data-status="stopped"' in html
    assert shown["events"].index("JobSubmitted") < shown["events"].index("JobStopped")
    assert f"/jobs/{job_id}/delete" in html and f"/jobs/{job_id}/stop" not in html
    assert "queue" not in shown  # no prediction for a job that no longer waits


async def test_a_job_is_not_found_by_those_who_may_not_see_it(gateway: Gateway) -> None:
    job_id = await gateway.submit("alice", "vision", name="private-run", project="vision", access="none")

    for user, projects in (("bob", ("other",)), ("carol", ("vision",))):
        status, html = await gateway.page(f"/jobs/{job_id}", user, *projects)
        assert status == 404
        assert "private-run" not in html and 'id="job"' not in html and 'id="events"' not in html
        assert "refusal" in texts_of(html)


async def test_what_the_job_author_wrote_is_shown_as_text(gateway: Gateway) -> None:
    job_id = await gateway.submit("alice", name=HOSTILE, env={"NOTE": HOSTILE})

    status, html = await gateway.page(f"/jobs/{job_id}", "alice")
    assert status == 200
    assert HOSTILE not in html and "<script>alert" not in html
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert html.count(escaped) >= 3  # the title, the heading and the dev environment's variables
    shown = texts_of(html)
    assert HOSTILE in shown["job"] and HOSTILE in shown["devenv-env"]


async def test_the_terminal_is_offered_only_to_those_who_may_use_it(gateway: Gateway) -> None:
    shared = {"project": "vision", "debug_terminal": DebugTerminal()}
    read_only = await gateway.submit("alice", "vision", name="debuggable", access="read-only", **shared)
    read_write = await gateway.submit("alice", "vision", name="debuggable-rw", access="read-write", **shared)
    without = await gateway.submit("alice", "vision", name="plain", access="read-write", project="vision")

    status, html = await gateway.page(f"/jobs/{read_only}", "alice", "vision")
    assert status == 200
    assert 'id="terminal-section"' in html and f'<div id="terminal" class="terminal" data-job="{read_only}"' in html
    assert "/static/console/terminal.js" in html and "/static/vendor/xterm/xterm.js" in html
    assert 'id="terminal-node"' in html and 'id="open-terminal"' in html

    status, html = await gateway.page(f"/jobs/{read_only}", "bob", "vision")
    assert status == 200 and "debuggable" in texts_of(html)["job"]
    assert 'id="terminal-section"' not in html and "xterm" not in html and "terminal.js" not in html
    assert f"/jobs/{read_only}/stop" not in html and f"/jobs/new?clone={read_only}" in html  # read-only: J2

    assert 'id="terminal-section"' in (await gateway.page(f"/jobs/{read_write}", "bob", "vision"))[1]
    assert 'id="terminal-section"' not in (await gateway.page(f"/jobs/{without}", "alice", "vision"))[1]


async def test_an_arrays_job_lists_the_array_by_index(gateway: Gateway) -> None:
    body = {"array_id": "array-0123456789ab", "indices": "0-2",
            "spec": msgspec.to_builtins(spec(name="sweep-{index}"))}
    job_ids = (await gateway.send("submit-array", body))["job_ids"]

    status, html = await gateway.page(f"/jobs/{job_ids[1]}", "alice")
    assert status == 200
    listed = texts_of(html)["array-jobs"]
    assert [listed.index(job_id) for job_id in job_ids] == sorted(listed.index(job_id) for job_id in job_ids)
    assert "sweep-1" in texts_of(html)["job"]


async def test_only_a_job_id_is_a_job_page_and_a_stranger_is_sent_to_sign_in(gateway: Gateway) -> None:
    _, html = await gateway.page("/jobs/new", "alice")
    assert 'id="job"' not in html
    job_id = await gateway.submit("alice")
    unsigned = await gateway.http.get(f"/jobs/{job_id}")
    assert unsigned.status_code == 303 and unsigned.headers["location"] == f"/signin?next=/jobs/{job_id}"


def test_the_console_scripts_write_no_markup() -> None:
    scripts = sorted(STATIC_CONSOLE.glob("*.js"))
    assert {"job.js", "ansi.js"} <= {script.name for script in scripts}
    for script in scripts:
        source = script.read_text()
        for sink in MARKUP_SINKS:
            assert not sink.search(source), f"{script.name} uses {sink.pattern}"
