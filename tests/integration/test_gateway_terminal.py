"""The console's debug terminal (J15) over a WebSocket: the gateway served by uvicorn in this process bridges the
browser to a shell in a running job's environment, opened by the real monitor and run by a real node agent, on
real NATS and PostgreSQL, as the signed-in person. The scheduler's side is its log, published by its relay: the
job is admitted on the agent's node, and the test starts its rank there as the launcher would. The console's
script (static/console/terminal.js) is driven in a real browser too (Debian's Chromium, tests/support/browser.py)."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvicorn
from nats.aio.client import Client
from nats.aio.msg import Msg
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Origin

from agent.agent import NodeAgent
from agent.isolation.workspace import BACKEND_VARIABLE, PLAIN
from libs.auth import issue_node_token, issue_token
from libs.contracts import subjects
from libs.contracts.agent import ProcessAccepted, StartProcess
from libs.contracts.events import JobAdmitted, JobSubmitted, NodeLaunch, Placement
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.operations.runs import OPEN_TERMINAL
from libs.eventstore import NewEvent, OutboxRelay
from libs.messaging.connection import round_trip
from libs.messaging.rpc import call
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.gateway.app import STATIC
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.security import SecurityHeaders
from services.gateway.sessions import SESSION_COOKIE, Sessions
from services.gateway.terminal import TerminalBridge
from services.monitor.service import Monitor
from tests.support.agents import CONTROL_SECRET, LAUNCHER, WAIT_SECONDS, start_agent
from tests.support.browser import driven, wait_for
from tests.support.monitor import start_monitor
from tests.support.schedulers import spec
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

# One secret signs people's tokens, the node's credential and the monitor's requests to the agent.
SECRET = CONTROL_SECRET
ALICE = Identity(user="alice", projects=["default"])  # the job's creator
BOB = Identity(user="bob", projects=["other"])  # may not see it
RANK = "import time; time.sleep(600)"  # the job's rank: running while the test debugs it
# A job's page as far as its terminal goes: the session's CSRF token, xterm.js and the console's terminal script.
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta name="csrf-token" content="{csrf}">
<link rel="stylesheet" href="/static/vendor/xterm/xterm.css">
<script src="/static/vendor/xterm/xterm.js" defer></script>
<script src="/static/vendor/xterm-addon-fit/addon-fit.js" defer></script>
<script src="/static/console/terminal.js" defer></script>
</head><body><div id="terminal" data-job="{job_id}" style="height: 480px"></div></body></html>"""


@dataclass
class Ending:
    """What the browser got: the output, what the gateway said in text frames, and how the socket closed."""

    output: bytearray = field(default_factory=bytearray)
    said: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")


@dataclass
class Site:
    """The gateway's terminal on a port of this machine, the monitor and a node agent running one job."""

    port: int
    sessions: Sessions
    agent: NodeAgent
    job_id: str
    asked: list[Msg]  # every OpenTerminal that reached NATS

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, job_id: str | None = None, query: str = "columns=120&rows=30") -> str:
        return f"ws://127.0.0.1:{self.port}/console/jobs/{job_id or self.job_id}/terminal?{query}"

    @property
    def origin(self) -> Origin:
        return Origin(f"http://127.0.0.1:{self.port}")

    def signed_in(self, identity: Identity) -> tuple[dict[str, str], str]:
        """A console session's cookie header and its CSRF token."""
        session_id, session = self.sessions.open(issue_token(SECRET, identity), identity)
        return {"Cookie": f"{SESSION_COOKIE}={session_id}"}, session.csrf

    @contextlib.asynccontextmanager
    async def page(self, identity: Identity = ALICE, *, job_id: str | None = None, query: str = "columns=120&rows=30",
                   origin: str | None = None) -> AsyncIterator[ClientConnection]:
        """The terminal as the console's page opens it: its cookie, its Origin, and the CSRF token first."""
        cookie, csrf = self.signed_in(identity)
        async with connect(self.url(job_id, query), additional_headers=cookie,
                           origin=Origin(origin) if origin else self.origin) as ws:
            await ws.send(json.dumps({"csrf": csrf}))
            yield ws


async def until_closed(ws: ClientConnection, ending: Ending | None = None) -> Ending:
    ending = ending or Ending()
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(WAIT_SECONDS):
            async for message in ws:
                if isinstance(message, bytes):
                    ending.output += message
                else:
                    ending.said.append(json.loads(message))
    ending.close_code = ws.close_code
    return ending


async def until_output(ws: ClientConnection, ending: Ending, text: str) -> None:
    async with asyncio.timeout(WAIT_SECONDS):
        while text not in ending.text:
            message = await ws.recv()
            assert isinstance(message, bytes), message
            ending.output += message


def bridge_tasks() -> list[asyncio.Task[Any]]:
    """The tasks of the gateway's terminals: each socket's forwarding, and each session's keep-alives."""
    return [task for task in asyncio.all_tasks() if not task.done()
            and getattr(task.get_coro(), "__qualname__", "").startswith(("TerminalBridge.", "DebugSession."))]


async def publish_scheduler_log(store_of: StoreFactory, nc: Client, *events: NewEvent) -> None:
    store = await store_of("scheduler")
    await store.append(list(events), expected_versions={("job", events[0].aggregate_id): 0})
    relay = OutboxRelay(store, nc.jetstream())
    while await relay.publish_pending():
        pass


@pytest_asyncio.fixture(loop_scope="session")
async def site(nc: Client, nats_url: str, database_url: str, tmp_path: Path, make_store: StoreFactory,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Site]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)
    runtime: ServiceRuntime
    monitor: Monitor
    runtime, monitor = await start_monitor(Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET))
    node = f"node-{uuid.uuid4().hex[:8]}"
    agent = await start_agent(nats_url, node, tmp_path, node_token=issue_node_token(SECRET, node))
    job_id = new_job_id()
    asked: list[Msg] = []

    async def spy(msg: Msg) -> None:
        asked.append(msg)

    spying = await nc.subscribe(OPEN_TERMINAL.subject, cb=spy)
    await round_trip(nc)
    connections = UserConnections(nats_url)
    sessions = Sessions()

    async def job_page(request: Request) -> Response:
        session = sessions.of(request)
        assert session is not None
        return HTMLResponse(PAGE.format(csrf=html.escape(session.csrf), job_id=html.escape(job_id)))

    # The terminal's routes as the gateway's app serves them, behind the same headers; and a page with it.
    app = Starlette(routes=[*TerminalBridge(UserCalls(connections), sessions).routes(),
                            Route("/job-page", job_page), Mount("/static", app=StaticFiles(directory=STATIC))],
                    middleware=[Middleware(SecurityHeaders)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False,
                                           lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            while not server.started:
                await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]

        # Admitted on the agent's node (the scheduler's log), and its rank started there (as the launcher would).
        await publish_scheduler_log(
            make_store, nc,
            NewEvent("job", job_id, JobSubmitted(job_id=job_id, spec=spec("debugged"), creator="alice")),
            NewEvent("job", job_id, JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=[
                Placement(rank=0, node=node, address="127.0.0.1", slots=1)])))
        await call(nc, subjects.agent_start(node), StartProcess(job_id=job_id, attempt=1, launch=NodeLaunch(
            rank=0, node=node, address="127.0.0.1", argv=[sys.executable, "-c", RANK], env={"GREETING": "forty-two"},
            mounts=[])), reply_type=ProcessAccepted, signer=LAUNCHER)

        async def ready() -> bool:
            known = monitor.jobs.jobs.get(job_id)
            rank = agent.ranks.nodes.get((job_id, 1, 0, 0))
            return (known is not None and known.status == "running" and rank is not None
                    and rank.workspace is not None and rank.is_running())

        await eventually(ready)
        yield Site(port=port, sessions=sessions, agent=agent, job_id=job_id, asked=asked)

        # Whichever way a socket ended, the gateway kept nothing of it running.
        async def nothing_left() -> bool:
            return not bridge_tasks()

        await eventually(nothing_left)
    finally:
        server.should_exit = True
        await asyncio.wait({serving}, timeout=WAIT_SECONDS)
        await connections.close()
        await spying.unsubscribe()
        await agent.close()
        await runtime.close()


async def test_a_command_typed_in_the_browsers_terminal_prints_its_output_and_its_exit_code_arrives(
        site: Site) -> None:
    ending = Ending()
    async with site.page() as ws:
        await ws.send(b"stty size; echo answer-$((6 * 7)) $GREETING\n")
        await until_output(ws, ending, "answer-42 forty-two")  # computed by the job's shell, not the keys' echo
        assert "30 120" in ending.text  # the size the page asked for

        await ws.send(json.dumps({"resize": [100, 40]}))
        await ws.send(b"echo resized-$((1 + 1))\n")
        await until_output(ws, ending, "resized-2")
        await ws.send(b"stty size; exit 7\n")
        await until_closed(ws, ending)

    assert "40 100" in ending.text
    assert ending.said == [{"exit": 7}]
    assert ending.close_code == 1000
    assert len(site.asked) == 1


async def test_a_program_with_a_bearer_token_needs_no_csrf_message(site: Site) -> None:
    headers = {"Authorization": f"Bearer {issue_token(SECRET, ALICE)}"}
    async with connect(site.url(), additional_headers=headers) as ws:
        await ws.send(b"echo from-a-program-$((2 * 3)); exit 3\n")
        ending = await until_closed(ws)
    assert "from-a-program-6" in ending.text
    assert ending.said == [{"exit": 3}]


@pytest.mark.parametrize("first", [
    b"ls\n",  # keystrokes before the token
    json.dumps({"csrf": "a-guessed-token"}),
    json.dumps({"resize": [80, 24]}),
])
async def test_a_page_without_its_csrf_token_is_refused_and_opens_nothing(site: Site, first: str | bytes) -> None:
    cookie, _ = site.signed_in(ALICE)
    async with connect(site.url(), additional_headers=cookie, origin=site.origin) as ws:
        await ws.send(first)
        ending = await until_closed(ws)
    assert ending.close_code == 4403
    assert [said["error"]["code"] for said in ending.said] == ["forbidden"]
    assert site.asked == [] and site.agent.debugging.sessions == {}


async def test_a_page_of_another_site_is_refused_even_with_the_token(site: Site) -> None:
    async with site.page(origin="https://evil.example") as ws:
        ending = await until_closed(ws)
    assert ending.close_code == 4403
    assert ending.said[0]["error"]["code"] == "forbidden"
    assert site.asked == [] and site.agent.debugging.sessions == {}


async def test_no_session_no_token_and_a_bad_size_are_refused_before_anything_is_asked(site: Site) -> None:
    async with connect(site.url(), origin=site.origin) as ws:
        await ws.send(json.dumps({"csrf": "whatever"}))
        unauthenticated = await until_closed(ws)
    async with site.page(query="columns=0&rows=24") as ws:
        bad_size = await until_closed(ws)

    assert unauthenticated.close_code == 4401 and unauthenticated.said[0]["error"]["code"] == "unauthenticated"
    assert bad_size.close_code == 4400 and "columns" in bad_size.said[0]["error"]["message"]
    assert site.asked == []


async def test_another_users_job_is_not_found_as_a_job_that_does_not_exist(site: Site) -> None:
    async with site.page(BOB) as ws:
        hidden = await until_closed(ws)
    made_up = new_job_id()
    async with site.page(BOB, job_id=made_up) as ws:
        missing = await until_closed(ws)

    assert hidden.close_code == missing.close_code == 4404
    [hidden_error], [missing_error] = [e["error"] for e in hidden.said], [e["error"] for e in missing.said]
    assert hidden_error["code"] == "not-found"
    assert hidden_error["message"].replace(site.job_id, "ID") == missing_error["message"].replace(made_up, "ID")
    assert hidden.output == b"" and site.agent.debugging.sessions == {}


async def test_closing_the_browsers_terminal_ends_the_shell_on_the_node(site: Site) -> None:
    ending = Ending()
    async with site.page() as ws:
        # A prompt made by the shell (not the echo of the keys): it waits at it for what is typed next.
        await ws.send(b"PS1=\"$(printf 'ready%s> ' -for-input)\"\n")
        await until_output(ws, ending, "ready-for-input> ")
        assert len(site.agent.debugging.sessions) == 1
    # The page went away at the shell's prompt: its input ends, and so does the shell, long before the agent
    # would end a session left without keep-alives.

    async def shell_ended() -> bool:
        return not site.agent.debugging.sessions

    await eventually(shell_ended)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    yield from driven()


def screen(driver: WebDriver) -> str:
    """What the terminal shows (xterm.js draws its rows in the page)."""
    return str(driver.find_element(By.CSS_SELECTOR, "#terminal .xterm-rows").text)


def sizes(driver: WebDriver) -> list[str]:
    """What each `stty size` printed so far."""
    return re.findall(r"^\d+ \d+$", screen(driver), re.MULTILINE)


def in_the_browser(site: Site, driver: WebDriver) -> None:
    session_id, _ = site.sessions.open(issue_token(SECRET, ALICE), ALICE)
    driver.get(f"{site.http}/static/vendor/xterm/xterm.css")  # the gateway's origin, for its cookie
    driver.add_cookie({"name": SESSION_COOKIE, "value": session_id, "path": "/"})
    driver.get(f"{site.http}/job-page")
    keys = wait_for(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea"),
                    what="the terminal")
    keys.send_keys("echo typed-$((6 * 7)) $GREETING; stty size" + Keys.ENTER)
    wait_for(driver, lambda d: "typed-42 forty-two" in screen(d) and sizes(d), what="the command's output")
    driver.set_window_size(800, 960)  # narrower: the terminal fits itself and tells the session
    keys.send_keys("stty size" + Keys.ENTER)
    wait_for(driver, lambda d: len(sizes(d)) == 2, what="the second size")
    before, after = (tuple(int(n) for n in size.split()) for size in sizes(driver))
    assert after[1] < before[1] and after[0] == before[0], (before, after)
    keys.send_keys("exit 5" + Keys.ENTER)
    wait_for(driver, lambda d: "The session ended with exit code 5" in screen(d), what="the exit code")


async def test_the_terminal_page_runs_what_is_typed_in_a_real_browser(site: Site, browser: WebDriver) -> None:
    await asyncio.to_thread(in_the_browser, site, browser)
    assert len(site.asked) == 1
