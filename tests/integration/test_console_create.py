"""The console's create-job page against a real scheduler on real NATS and PostgreSQL, with one node registered:
the form in both languages, a job created from it as the CLI would create it from a spec file, refusals shown
beside their fields with the form kept, a clone and an uploaded spec prefilling it, the cluster's resources and
the queue prediction the page's script shows, and forms from elsewhere refused."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from html import unescape

import httpx
import pytest_asyncio
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.contracts import subjects
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, NodeRegistered
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import DatasetRef, DebugTerminal, JobSpec
from services.gateway.app import build_app
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.console.base import Console
from services.gateway.console.create import CreatePage
from services.gateway.sessions import SESSION_COOKIE, Sessions
from tests.support.schedulers import Schedulers, spec, token
from tests.support.waiting import eventually

ORIGIN = {"Origin": "http://gateway"}
CHINESE = {"Accept-Language": "zh-CN,zh;q=0.9"}
NODE = NodeInfo(name="node-a", address="127.0.0.1", os="Ubuntu 22.04", kernel="6.1.0", cpus=4, memory_mib=8192)


@dataclass
class Person:
    """A signed-in browser: its session's cookie, and the CSRF token its pages carry."""

    client: httpx.AsyncClient
    csrf: str
    user_token: str

    async def post(self, fields: dict[str, str | list[str]], *, csrf: bool = True,
                   files: dict[str, tuple[str, bytes, str]] | None = None) -> httpx.Response:
        data = {**fields, **({"csrf_token": self.csrf} if csrf else {})}
        return await self.client.post("/jobs/new", data=data, files=files, headers=ORIGIN)

    async def jobs(self, nats_url: str) -> list[str]:
        async with TrainyardClient.connect(nats_url, token=self.user_token) as api:
            return [job.name for job in await api.list_jobs()]

    async def spec_of(self, nats_url: str, job_id: str) -> tuple[JobSpec, str | None]:
        async with TrainyardClient.connect(nats_url, token=self.user_token) as api:
            details = await api.get_job(job_id)
            return details.spec, details.job.cloned_from


@dataclass
class Gateway:
    connections: UserConnections
    sessions: Sessions
    schedulers: Schedulers

    def browser(self, cookies: dict[str, str] | None = None) -> httpx.AsyncClient:
        app = build_app(self.connections, self.sessions)
        # The page's routes come before the jobs page's /jobs/{job_id}/{action}, as the gateway registers them.
        app.router.routes[:0] = CreatePage(Console(UserCalls(self.connections), self.sessions)).routes()
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", cookies=cookies)

    async def person(self, user: str, *, admin: bool = False) -> Person:
        user_token = token(user, admin=admin)
        session_id, session = self.sessions.open(user_token, Identity(user=user, projects=["default"], admin=admin))
        return Person(client=self.browser({SESSION_COOKIE: session_id}), csrf=session.csrf, user_token=user_token)


async def registered(nc: Client, node: NodeInfo) -> None:
    """The node's registration, as the monitor's outbox relay publishes it."""
    event = NodeRegistered(node=node)
    envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="node",
                             aggregate_id=node.name, version=1, position=1, recorded_at=datetime.now(UTC), event=event)
    await nc.jetstream().publish(subjects.event_subject("monitor", "node", "NodeRegistered"),
                                 encode(envelope))


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str, nc: Client, schedulers: Schedulers) -> AsyncIterator[Gateway]:
    await schedulers.start()
    (schedulers.settings.storage_root / "datasets" / "imagenet").mkdir(parents=True)
    await registered(nc, NODE)
    connections = UserConnections(nats_url)
    async with TrainyardClient.connect(nats_url, token=token("admin", admin=True)) as api:
        await eventually(lambda: _has_node(api))
    yield Gateway(connections, Sessions(), schedulers)
    await connections.close()


async def _has_node(api: TrainyardClient) -> bool:
    return any(node.info.name == NODE.name for node in await api.nodes())


def form_fields(**changes: str | list[str]) -> dict[str, str | list[str]]:
    """A filled-in form, as a browser sends it when its Create button is pressed."""
    fields: dict[str, str | list[str]] = {
        "job_id": new_job_id(), "name": "resnet", "project": "default", "access": "none", "type": "regular",
        "priority": "normal", "mode": "single-node", "nodes": "1", "flavors": ["cpu-1"], "algorithm_name": "algo",
        "algorithm_source": "private", "command": "python3 train.py", "output": "out", "action": "create",
    }
    return {**fields, **changes}


def input_value(html: str, name: str) -> str:
    found = re.search(rf'<input[^>]*\bname="{re.escape(name)}"[^>]*\bvalue="([^"]*)"', html)
    assert found, f"no input {name}"
    return unescape(found.group(1))


def textarea(html: str, element_id: str) -> str:
    found = re.search(rf'<textarea[^>]*\bid="{element_id}"[^>]*>(.*?)</textarea>', html, re.S)
    assert found, f"no textarea {element_id}"
    return unescape(found.group(1))


def error_beside(html: str, slot: str) -> str:
    found = re.search(rf'<div class="field-error" id="error-{slot}"[^>]*>(.*?)</div>', html, re.S)
    assert found, f"no error place for {slot}"
    return unescape(re.sub(r"<[^>]+>", "", found.group(1))).strip()


def checked_flavors(html: str) -> list[str]:
    return re.findall(r'name="flavors" value="([^"]+)" checked', html)


async def test_the_form_offers_every_part_in_both_languages(gateway: Gateway) -> None:
    alice = await gateway.person("alice")
    page = await alice.client.get("/jobs/new")
    assert page.status_code == 200
    html = page.text
    assert 'id="create-form"' in html and 'id="create-submit"' in html and 'id="prediction"' in html
    assert re.fullmatch(r"job-[0-9a-f]{12}", input_value(html, "job_id"))
    offered = re.findall(r'name="flavors" value="([^"]+)"', html)
    assert offered == ["cpu-1", "cpu-2", "sim-gpu-1"]
    assert "sim-a100" in html and "Queued jobs need 0 boards" in html  # the board-model filter, with its demand
    assert 'id="show-resources"' in html and "Cluster available resources" in html
    assert 'value="very-urgent"' not in html  # administrators only
    for name in ("nodes", "mode", "command", "env", "duration", "max_resumes", "max_restarts", "retention",
                 "datasets-0-name", "tasks-0-command", "models-0-name", "volumes-0-name", "before_start"):
        assert f'name="{name}"' in html, name

    chinese = await alice.client.get("/jobs/new", headers=CHINESE)
    assert "创建任务式训练" in chinese.text and "集群可用资源" in chinese.text and "运行指令" in chinese.text
    admin = await gateway.person("root", admin=True)
    assert 'value="very-urgent"' in (await admin.client.get("/jobs/new")).text

    signed_out = await gateway.browser().get("/jobs/new")
    assert signed_out.status_code == 303 and signed_out.headers["location"].startswith("/signin")


async def test_a_posted_form_creates_the_job_it_describes_once(gateway: Gateway, nats_url: str) -> None:
    bob = await gateway.person("bob")
    fields = form_fields(
        name="big-run", access="read-only", priority="urgent", mode="pytorch", nodes="2", flavors=["cpu-2", "cpu-1"],
        command="torchrun train.py --epochs 3", **{"datasets-0-name": "imagenet", "datasets-0-source": "private",
                                                   "datasets-0-read_only": "on"},
        env="LR=0.1\nBATCH=64", duration="4h", debug_terminal="on", retention="2h")
    created = await bob.post(fields)
    assert created.status_code == 303, created.text
    job_id = str(fields["job_id"])
    assert created.headers["location"] == f"/jobs/{job_id}"

    stored, cloned_from = await bob.spec_of(nats_url, job_id)
    assert (stored.name, stored.access, stored.priority, stored.mode, stored.nodes) == (
        "big-run", "read-only", "urgent", "pytorch", 2)
    assert stored.flavors == ["cpu-2", "cpu-1"] and stored.command == "torchrun train.py --epochs 3"
    assert stored.datasets == [DatasetRef(name="imagenet", read_only=True)]
    assert stored.env == {"LR": "0.1", "BATCH": "64"} and stored.duration == "4h"
    assert stored.debug_terminal == DebugTerminal(enabled=True, retention="2h") and cloned_from is None

    again = await bob.post(fields)  # the same form sent twice (a reload, a double click): still one job
    assert again.status_code == 303 and again.headers["location"] == f"/jobs/{job_id}"
    assert await bob.jobs(nats_url) == ["big-run"]


async def test_a_bad_command_is_refused_beside_it_and_nothing_is_stored(gateway: Gateway, nats_url: str) -> None:
    carol = await gateway.person("carol")
    refused = await carol.post(form_fields(name="<script>alert(1)</script>", command="KEY=1 python3 train.py"))
    assert refused.status_code == 422
    html = refused.text
    assert "must begin with an executable" in error_beside(html, "command")
    assert "variable assignment" in error_beside(html, "command") and error_beside(html, "name") == ""
    assert textarea(html, "command") == "KEY=1 python3 train.py"  # the form is kept as typed
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert input_value(html, "name") == "<script>alert(1)</script>"
    assert await carol.jobs(nats_url) == []

    shell = await carol.post(form_fields(command="python3 train.py && python3 evaluate.py", nodes="2"))
    assert shell.status_code == 422
    assert "'&&'" in error_beside(shell.text, "command")
    assert "single-node jobs run on exactly 1 node" in error_beside(shell.text, "nodes")

    unknown = await carol.post(form_fields(flavors=["cpu-1", "gpu-huge"]))  # only the scheduler knows its flavors
    assert unknown.status_code == 422
    assert "'gpu-huge' is not a flavor of this cluster" in error_beside(unknown.text, "flavors")
    assert checked_flavors(unknown.text) == ["cpu-1", "gpu-huge"]
    assert await carol.jobs(nats_url) == []


async def test_a_form_without_the_sessions_csrf_token_creates_nothing(gateway: Gateway, nats_url: str) -> None:
    dave = await gateway.person("dave")
    forged = await dave.post(form_fields(), csrf=False)
    assert forged.status_code == 403
    elsewhere = await dave.client.post("/jobs/new", data={**form_fields(), "csrf_token": dave.csrf},
                                       headers={"Origin": "http://evil.example"})
    assert elsewhere.status_code == 403
    assert await dave.jobs(nats_url) == []


async def test_a_clone_is_prefilled_and_created_from_its_source(gateway: Gateway, nats_url: str) -> None:
    erin = await gateway.person("erin")
    async with TrainyardClient.connect(nats_url, token=erin.user_token) as api:
        source = (await api.submit(spec("nightly", flavors=["cpu-2"], command="python3 nightly.py --full",
                                        env={"SEED": "7"}, duration="1d"), job_id=new_job_id())).job_id
    form = await erin.client.get("/jobs/new", params={"clone": source})
    assert form.status_code == 200
    html = form.text
    assert input_value(html, "name") == "nightly-clone" and input_value(html, "clone") == source
    assert textarea(html, "command") == "python3 nightly.py --full" and textarea(html, "env") == "SEED=7"
    assert checked_flavors(html) == ["cpu-2"] and input_value(html, "duration") == "1d"
    assert input_value(html, "job_id") != source

    fields = {name: input_value(html, name) for name in ("job_id", "clone", "name", "algorithm_name", "output",
                                                         "nodes", "duration")}
    cloned = await erin.post({**fields, "command": textarea(html, "command"), "env": textarea(html, "env"),
                              "flavors": ["cpu-2"], "mode": "single-node", "type": "regular", "access": "none",
                              "priority": "normal", "project": "default", "action": "create"})
    assert cloned.status_code == 303, cloned.text
    stored, cloned_from = await erin.spec_of(nats_url, fields["job_id"])
    assert cloned_from == source and stored.name == "nightly-clone" and stored.env == {"SEED": "7"}

    missing = await erin.client.get("/jobs/new", params={"clone": "job-000000000000"})
    assert missing.status_code == 404


async def test_an_uploaded_spec_file_fills_the_form(gateway: Gateway, nats_url: str) -> None:
    frank = await gateway.person("frank")
    document = b"""
name: from-yaml
type: batch
mode: tensorflow
nodes: 2
parameter_servers: 1
flavors: [cpu-1]
tasks:
  - {algorithm: {name: algo}, command: python3 a.py}
  - {algorithm: {name: algo, read_only: true}, command: python3 b.py}
output: {name: out}
checkpoint_resume: {max_resumes: 2, elastic: {min_nodes: 1}}
pool: dedicated
"""
    filled = await frank.post(form_fields(action="upload"), files={"spec_file": ("job.yaml", document, "text/yaml")})
    assert filled.status_code == 200, filled.text
    html = filled.text
    assert input_value(html, "name") == "from-yaml" and input_value(html, "parameter_servers") == "1"
    assert input_value(html, "tasks-0-command") == "python3 a.py"
    assert input_value(html, "tasks-1-command") == "python3 b.py"
    assert re.search(r'name="tasks-1-read_only" value="on" checked', html)
    assert re.search(r'name="type" value="batch" checked', html)
    assert input_value(html, "max_resumes") == "2" and input_value(html, "pool") == "dedicated"
    assert "checkpoint_resume" in html and 'name="elastic" value="on" data-shows="elastic-settings" checked' in html
    assert await frank.jobs(nats_url) == []  # filling the form creates nothing

    broken = await frank.post(form_fields(action="upload", name="kept"),
                              files={"spec_file": ("job.yaml", b"name: x\ncolour: red\n", "text/yaml")})
    assert broken.status_code == 422
    assert "colour" in broken.text and input_value(broken.text, "name") == "kept"
    too_large = await frank.post(form_fields(action="upload"),
                                 files={"spec_file": ("job.yaml", b"#" * (256 * 1024 + 1), "text/yaml")})
    assert too_large.status_code == 413


async def test_the_yaml_view_shows_the_spec_and_fills_the_form_back(gateway: Gateway) -> None:
    grace = await gateway.person("grace")
    shown = await grace.post(form_fields(name="as-yaml", env="A=1", action="yaml"))
    assert shown.status_code == 200
    text = textarea(shown.text, "spec-yaml")
    assert "name: as-yaml" in text and "command: python3 train.py" in text and "A: '1'" in text

    edited = text.replace("name: as-yaml", "name: edited").replace("nodes: 1", "nodes: 3").replace(
        "mode: single-node", "mode: horovod")
    applied = await grace.post(form_fields(action="apply-yaml", spec_yaml=edited))
    assert applied.status_code == 200
    assert input_value(applied.text, "name") == "edited" and input_value(applied.text, "nodes") == "3"
    assert re.search(r'<option value="horovod" selected', applied.text)


async def test_the_scripts_reading_prediction_and_resources(gateway: Gateway) -> None:
    """What the page's script asks: the form read as a spec, then predict-job and get-resources over the API."""
    heidi = await gateway.person("heidi")
    bad = (await heidi.post(form_fields(command="A=1 python3 x.py", action="check"))).json()
    assert not bad["valid"] and bad["spec"] is None
    assert [error["field"] for error in bad["errors"]] == ["command"]

    good = (await heidi.post(form_fields(name="quick", action="check"))).json()
    assert good["valid"] and good["errors"] == [] and good["spec"]["name"] == "quick"
    api = {"X-CSRF-Token": heidi.csrf, **ORIGIN}
    predicted = await heidi.client.post("/api/v1/predict-job", json={"spec": good["spec"]}, headers=api)
    assert predicted.json()["prediction"]["starts_now"] is True
    huge = {**good["spec"], "flavors": ["cpu-2"], "nodes": 3, "mode": "pytorch"}  # more nodes than the cluster has
    waits = (await heidi.client.post("/api/v1/predict-job", json={"spec": huge}, headers=api)).json()["prediction"]
    assert waits["starts_now"] is False and waits["position"] == 1

    nodes = (await heidi.client.post("/api/v1/get-resources", json={"flavors": ["cpu-1"]}, headers=api)).json()
    assert [node["name"] for node in nodes["nodes"]] == ["node-a"]
    chosen = {"flavor": ["cpu-1", "cpu-2", "sim-gpu-1"]}
    page = await heidi.client.get("/jobs/new/resources", params=chosen)
    assert page.status_code == 200 and 'id="resources"' in page.text and 'data-node="node-a"' in page.text
    assert "cpu-1: Idle" in page.text and "cpu-2: Idle" in page.text and "sim-gpu-1" not in cells(page.text, 1)
    assert "Ubuntu 22.04 6.1.0" in page.text and cells(page.text, 3) == "0/8" and cells(page.text, 4) == "0/4"

    assert (await heidi.post(form_fields(name="holder", flavors=["cpu-2"]))).status_code == 303

    async def held() -> str | None:
        shown = await heidi.client.get("/jobs/new/resources", params=chosen, headers=CHINESE)
        return shown.text if "0(0):holder" in shown.text else None

    held_page = await eventually(held)  # the job is admitted on the node at the next scheduling cycle
    assert cells(held_page, 4) == "2/4" and "cpu-2: 紧张" not in held_page and "cpu-2: 空闲" in held_page
    assert "集群可用资源" in held_page


def cells(html: str, column: int) -> str:
    """The text of one column of the resources table's first row."""
    row = re.search(r'<tr data-node="[^"]+">(.*?)</tr>', html, re.S)
    assert row, "no node in the table"
    return unescape(re.sub(r"<[^>]+>", "", re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)[column])).strip()
