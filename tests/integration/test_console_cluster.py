"""The console's cluster pages against a real scheduler and monitor (and autoscaler) on real NATS and PostgreSQL:
the registered nodes and the flavors in both languages, an administrator's fault mark showing as the node's
problem and as an alert (what the mark's reason says shown as text, never as markup), the nodes' unpacked images
from their cache reports, the image marks and the settings changed by forms; the administrators' page refused
to others, and a service that does not answer leaving a notice instead of a broken page."""

from __future__ import annotations

import io
import re
import tarfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from html import unescape
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.auth import issue_node_token
from libs.contracts import subjects
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.cluster import ClusterConfig, NodeInfo
from libs.contracts.codec import encode
from libs.contracts.datacache import CachedImage, CacheEntry, CacheReport
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.messaging.rpc import call
from libs.skeleton.runtime import ServiceRuntime
from services.autoscaler.service import Autoscaler
from services.gateway.app import build_app
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.console.base import Console
from services.gateway.console.cluster import ClusterPages
from services.gateway.sessions import SESSION_COOKIE, Sessions
from tests.support.schedulers import CLUSTER, SECRET, Schedulers, spec, token
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
ORIGIN = {"Origin": "http://gateway"}
HOSTILE = "<script>alert('owned')</script>"


class Browser:
    """A signed-in person's browser on the gateway: their session cookie, and forms posted with its CSRF token."""

    def __init__(self, client: httpx.AsyncClient, csrf: str) -> None:
        self.client = client
        self.csrf = csrf

    async def get(self, path: str, *, chinese: bool = False) -> httpx.Response:
        return await self.client.get(path, headers={"Accept-Language": "zh-CN,zh;q=0.9" if chinese else "en"})

    async def post_form(self, path: str, fields: dict[str, str], *, csrf: bool = True) -> httpx.Response:
        data = {**fields, "csrf_token": self.csrf} if csrf else fields
        return await self.client.post(path, data=data, headers=ORIGIN)


@dataclass
class Gateway:
    nats_url: str
    sessions: Sessions
    connections: UserConnections
    clients: list[httpx.AsyncClient]

    def browser(self, user: str, *, admin: bool = False) -> Browser:
        session_id, session = self.sessions.open(token(user, admin=admin),
                                                 Identity(user=user, projects=["default"], admin=admin))
        app = build_app(self.connections, self.sessions)
        app.router.routes.extend(ClusterPages(Console(UserCalls(self.connections), self.sessions)).routes())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                   cookies={SESSION_COOKIE: session_id})
        self.clients.append(client)
        return Browser(client, session.csrf)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str) -> AsyncIterator[Gateway]:
    """The console's cluster pages in the test's process, on the test's NATS; the services are the test's own."""
    opened = Gateway(nats_url, Sessions(), UserConnections(nats_url), [])
    yield opened
    for client in opened.clients:
        await client.aclose()
    await opened.connections.close()


async def register(nc: Client, name: str) -> None:
    """A node agent's registration with the monitor, with the node's own credential."""
    info = NodeInfo(name=name, address="127.0.0.1", cpus=8, memory_mib=16384, os="Linux", kernel="6.1")
    reply = await call(nc, REGISTER_NODE.subject, RegisterNode(node=info), reply_type=NodeAccepted | CommandError,
                       token=issue_node_token(SECRET, name))
    assert isinstance(reply, NodeAccepted), reply


def node_row(html: str, node: str) -> str:
    found = re.search(rf'<tr data-node="{node}">(.*?)</tr>', html, re.S)
    assert found, html[:2000]
    return found.group(1)


def cells(row: str) -> list[str]:
    return [" ".join(unescape(re.sub(r"<[^>]+>", " ", cell)).split()) for cell in re.findall(r"<td[^>]*>(.*?)</td>",
                                                                                             row, re.S)]


async def node_shown(browser: Browser, node: str, text: str) -> str | None:
    """The cluster page once it lists `node` with `text` in its state: None before (the scheduler may not have folded
    the node's registration yet, and then the page has no row for it)."""
    page = await browser.get("/cluster")
    if f'<tr data-node="{node}">' not in page.text:
        return None
    return page.text if text in cells(node_row(page.text, node))[1] else None


async def alert_page_naming(browser: Browser, text: str) -> httpx.Response | None:
    page = await browser.get("/cluster/alerts")
    return page if text in page.text else None


async def test_the_nodes_and_flavors_are_listed_in_both_languages(
        gateway: Gateway, schedulers: Schedulers, lone_monitor: None, nc: Client) -> None:
    await schedulers.start()
    await register(nc, "node-a")
    alice = gateway.browser("alice")
    await eventually(lambda: node_shown(alice, "node-a", "Ready"))

    page = await alice.get("/cluster")
    assert page.status_code == 200
    assert cells(node_row(page.text, "node-a")) == [
        "node-a", "Ready", "127.0.0.1", "0 / 8", "0 / 16384", "–", "–", "Linux / 6.1", "–", "–"]
    flavors = re.findall(r'<tr data-flavor="([^"]+)">', page.text)
    assert flavors == [flavor.name for flavor in ClusterConfig.load(CLUSTER).flavors]
    assert "No queued job needs boards." in page.text

    chinese = await alice.get("/cluster", chinese=True)
    assert chinese.status_code == 200
    for term in ("集群", "节点", "算力规格", "就绪", "可调度节点数"):
        assert term in chinese.text, term
    assert "Ready" not in chinese.text


async def test_others_than_administrators_are_refused_the_administration_page(
        gateway: Gateway, schedulers: Schedulers, lone_monitor: None, nc: Client) -> None:
    await schedulers.start()
    await register(nc, "node-a")
    alice = gateway.browser("alice")
    for path in ("/cluster", "/cluster/alerts", "/cluster/caches", "/cluster/autoscaler"):
        page = await alice.get(path)
        assert page.status_code == 200, path
        assert "/cluster/admin" not in page.text and 'id="admin-link"' not in page.text, path

    refused = await alice.get("/cluster/admin")
    assert refused.status_code == 403 and "Only administrators may see this page." in refused.text
    forced = await alice.post_form("/cluster/admin/mark-component", {"node": "node-a", "component": "board:0"})
    assert forced.status_code == 403
    await eventually(lambda: node_shown(alice, "node-a", "Ready"))  # still ready: nothing was marked

    root = gateway.browser("root", admin=True)
    assert 'id="admin-link"' in (await root.get("/cluster")).text
    assert (await root.get("/cluster/admin")).status_code == 200


async def test_an_administrator_marks_a_component_faulty_and_the_node_shows_the_problem(
        gateway: Gateway, schedulers: Schedulers, lone_monitor: None, nc: Client) -> None:
    await schedulers.start()
    await register(nc, "node-a")
    root, alice = gateway.browser("root", admin=True), gateway.browser("alice")
    await eventually(lambda: node_shown(alice, "node-a", "Ready"))

    mark = {"node": "node-a", "component": "board:0", "reason": HOSTILE, "faulty": "yes"}
    unsigned = await root.post_form("/cluster/admin/mark-component", mark, csrf=False)
    assert unsigned.status_code == 403
    marked = await root.post_form("/cluster/admin/mark-component", mark)
    assert marked.status_code == 303 and marked.headers["location"] == "/cluster/admin?done=marked"

    page = await eventually(lambda: node_shown(alice, "node-a", "Unhealthy"))
    problems = cells(node_row(page, "node-a"))[-1]
    assert problems == f"board:0 faulty (marked by root: {HOSTILE})"
    assert HOSTILE not in page and "&lt;script&gt;" in page  # the reason is shown as text

    # The monitor raises the alert once it recorded the node unhealthy: the page lists it from then on.
    alerts = await eventually(lambda: alert_page_naming(alice, "Node node-a is unhealthy"))
    assert alerts.status_code == 200
    assert HOSTILE not in alerts.text and "&lt;script&gt;" in alerts.text
    assert re.search(r'<tr data-event="[^"]+" class="alert node-unhealthy">', alerts.text)

    admin_page = await root.get("/cluster/admin?done=marked")
    assert "The component is marked faulty." in admin_page.text
    assert '<tr data-mark="node-a board:0">' in admin_page.text and HOSTILE not in admin_page.text
    wrong = await root.post_form("/cluster/admin/mark-component", {"node": "node-a", "component": "disk 1"})
    assert wrong.status_code == 400 and "Name the component as kind:name" in wrong.text

    cleared = await root.post_form("/cluster/admin/mark-component",
                                   {"node": "node-a", "component": "board:0", "faulty": "no"})
    assert cleared.status_code == 303 and cleared.headers["location"] == "/cluster/admin?done=cleared"
    await eventually(lambda: node_shown(alice, "node-a", "Ready"))
    assert "No component is marked faulty." in (await root.get("/cluster/admin")).text


async def caches_page_with(browser: Browser, text: str, *, chinese: bool = False) -> str | None:
    page = await browser.get("/cluster/caches", chinese=chinese)
    return page.text if page.status_code == 200 and text in page.text else None


async def test_the_caches_page_shows_the_images_each_node_keeps_unpacked_in_both_languages(
        gateway: Gateway, schedulers: Schedulers, lone_monitor: None, nc: Client) -> None:
    await schedulers.start()
    node = f"node-{uuid.uuid4().hex[:8]}"  # the cache reports' stream outlives a test
    await register(nc, node)
    alice = gateway.browser("alice")
    assert await eventually(lambda: caches_page_with(alice, "No node keeps an unpacked image yet."))

    at = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    entry = CacheEntry(key="0" * 24, source="datasets/imgs", bytes=2**20, files=1, staged_at=at, last_used=at)
    image = CachedImage(key="5a2e07c4bd31" + "0" * 12, digest="sha256:5a2e07c4bd31" + "0" * 52, ref=HOSTILE,
                        format="oci-archive", bytes=3 * 2**30, unpacked_at=at, last_used=at,
                        pins=["job-0123456789ab/1/0/0", "job-0123456789ab/1/0/1"])
    older = CachedImage(key="6" * 24, digest="sha256:" + "6" * 64, format="rootfs", bytes=2**20, unpacked_at=at,
                        last_used=at)  # unpacked by an agent that did not keep the reference
    report = CacheReport(node=node, sent_at=datetime.now(UTC), entries=[entry], total_entries=7342,
                         images=[image, older])
    await nc.jetstream().publish(subjects.agent_cache(node), encode(report))

    page = await eventually(lambda: caches_page_with(alice, 'id="image-caches"'))
    rows = dict(re.findall(r'<tr data-cached-image="([^"]+)">(.*?)</tr>', page, re.S))
    assert cells(rows[f"{node} {image.key}"]) == [
        node, HOSTILE, "5a2e07c4bd31", "oci-archive", "3072.0", "2026-11-25 12:00:00", "2026-11-25 12:00:00",
        "job-0123456789ab"]
    assert cells(rows[f"{node} {older.key}"])[:2] == [node, "–"] and cells(rows[f"{node} {older.key}"])[-1] == "–"
    assert HOSTILE not in page and "&lt;script&gt;" in page  # what an agent reports is shown as text
    assert cells(node_row(page, node))[1] == "1 / 7342" and 'id="cache-cut-short"' in page

    chinese = await alice.get("/cluster/caches", chinese=True)
    for term in ("镜像缓存", "解压时间", "数据集缓存"):
        assert term in chinese.text, term
    assert "Image caches" not in chinese.text


def rootfs_tarball(path: Path) -> Path:
    with tarfile.open(path, "w") as archive:
        member = tarfile.TarInfo("etc/os-release")
        member.size = 8
        archive.addfile(member, io.BytesIO(b"ID=tiny\n"))
    return path


async def test_an_administrator_changes_settings_and_image_marks_with_forms(
        gateway: Gateway, schedulers: Schedulers, nats_url: str, tmp_path: Path) -> None:
    await schedulers.start()
    async with TrainyardClient.connect(nats_url, token=token("root", admin=True)) as admin:
        await admin.register_image("tiny/base:1", rootfs_tarball(tmp_path / "tiny.tar"), boards=["cpu"],
                                   description=HOSTILE)
        root = gateway.browser("root", admin=True)
        page = await root.get("/cluster/admin")
        assert page.status_code == 200
        assert 'name="urgent_cap" value="5"' in page.text and HOSTILE not in page.text

        changed = await root.post_form("/cluster/admin/change-settings", {"urgent_cap": "2", "sharing_enabled": "off"})
        assert changed.status_code == 303 and changed.headers["location"] == "/cluster/admin?done=settings"
        settings = await admin.settings()
        assert (settings.urgent_cap, settings.sharing_enabled, settings.max_resumes_cap) == (2, False, 10)
        unchanged = await root.post_form("/cluster/admin/change-settings", {"urgent_cap": "2"})
        assert unchanged.headers["location"] == "/cluster/admin?done=unchanged"

        bad = await root.post_form("/cluster/admin/change-settings", {"urgent_cap": "-1", "submit_rate": "7"})
        assert bad.status_code == 400 and "Urgent cap: a whole number, 0 or more" in bad.text
        assert 'name="urgent_cap" value="-1"' in bad.text  # the form as it was sent, to correct
        refused = await root.post_form("/cluster/admin/change-settings", {"debug_retention": "soon"})
        assert refused.status_code == 400 and "debug_retention" in refused.text
        assert (await admin.settings()).submit_rate == settings.submit_rate  # nothing was changed

        unmarked = await root.post_form("/cluster/admin/mark-image", {"ref": "tiny/base:1", "training": "no"})
        assert unmarked.headers["location"] == "/cluster/admin?done=image-unmarked"
        assert [image.training for image in await admin.images()] == [False]
        caches = await gateway.browser("alice").get("/cluster/caches")
        row = re.search(r'<tr data-image="tiny/base:1">(.*?)</tr>', caches.text, re.S)
        assert row and cells(row.group(1))[:3] == ["tiny/base:1", "cpu", "No"]
        assert "Mark for training" not in caches.text  # marking is the administrators' page's
        assert HOSTILE not in caches.text and "&lt;script&gt;" in caches.text

    alice_forced = await gateway.browser("alice").post_form("/cluster/admin/mark-image",
                                                            {"ref": "tiny/base:1", "training": "yes"})
    assert alice_forced.status_code == 403


async def test_a_service_that_does_not_answer_leaves_a_notice(gateway: Gateway, schedulers: Schedulers) -> None:
    alice = gateway.browser("alice")
    nothing = await alice.get("/cluster")  # no service runs at all
    assert nothing.status_code == 200
    assert nothing.text.count("The scheduler does not answer right now") == 2  # the nodes, the flavors

    await schedulers.start()  # the scheduler only: no monitor, no autoscaler
    nodes = await alice.get("/cluster")
    assert "does not answer" not in nodes.text and "No nodes are registered." in nodes.text
    alerts = await alice.get("/cluster/alerts")
    assert alerts.status_code == 200 and "The monitor does not answer right now" in alerts.text
    assert '<script src="/static/console/cluster.js" defer></script>' in alerts.text
    caches = await alice.get("/cluster/caches")
    assert caches.status_code == 200 and "The monitor does not answer right now" in caches.text
    assert "No images are registered" in caches.text  # the scheduler's part is shown
    autoscaler = await alice.get("/cluster/autoscaler", chinese=True)
    assert autoscaler.status_code == 200 and "自动扩缩容服务" in autoscaler.text


async def test_the_autoscaler_page_shows_the_queue_per_flavor(
        gateway: Gateway, schedulers: Schedulers, nats_url: str, database_url: str) -> None:
    await schedulers.start()
    runtime = ServiceRuntime("autoscaler", schedulers.settings)
    await runtime.start()
    autoscaler = Autoscaler(runtime, ClusterConfig.load(CLUSTER), providers={})
    await autoscaler.start()
    await runtime.listen()
    try:
        async with TrainyardClient.connect(nats_url, token=token("alice")) as client:
            await client.submit(spec(flavors=["cpu-2"]), job_id=new_job_id())
        alice = gateway.browser("alice")

        async def queued() -> str | None:
            page = await alice.get("/cluster/autoscaler")
            return page.text if '<tr data-flavor="cpu-2"><td>cpu-2</td><td class="number">1</td></tr>' in page.text \
                else None

        page = await eventually(queued)
        assert re.search(r'id="queued-jobs">1<', page)
        assert "The autoscaler has no instances now." in page
    finally:
        await runtime.close()
