"""Every operation people may send, through the HTTP API (`POST /api/v1/<operation>`, docs/http-api.md) of the
gateway, against the whole stack: real services, agents, NATS and PostgreSQL. Each is sent a valid request, in the
order a person would send them, and must answer 200 with its reply type; each follow stream is read once. The set of
operations sent is checked against the catalogue, so an operation added for people and not sent here fails."""

from __future__ import annotations

import asyncio
import secrets
import tarfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from libs.auth import issue_token
from libs.contracts.agent import LogChunk
from libs.contracts.arrays import new_array_id
from libs.contracts.events import AlertRaised, EventEnvelope
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.operations import alerts, arrays, autoscaler, cache, cluster, images, jobs, planning, runs, watches
from libs.contracts.operations.base import Operation, ReplyT, RequestT
from libs.contracts.operations.catalogue import OPERATIONS
from libs.contracts.operations.jobs import JobView
from libs.contracts.operations.runs import SeriesPoint
from libs.imagefiles import file_digest
from libs.natsroles import inbox_prefix, user_nats_name
from tests.support.specs import sleeper
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

PROBLEM = "application/problem+json"
DATASET = "http-data"
IMAGE_NAME, IMAGE_TAG = "http/tiny", "1"
FAULTY_NODE = "node-b"  # marked faulty for an alert; the running job is kept off it
# Codes the services refuse a well-formed request with; the gateway's own at its edge are invalid-request (a bad
# body) and unauthenticated (no token).
DOMAIN_CODES = {"not-found", "conflict", "invalid-state", "forbidden", "over-cap", "invalid-spec"}


def people_operations() -> set[str]:
    return {operation.name for operation in OPERATIONS if "user" in operation.callers}


@dataclass(frozen=True)
class Event:
    kind: str
    data: bytes


class HttpApi:
    """The gateway's HTTP API, as a program calls it; remembers which operations answered."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.answered: set[str] = set()

    async def post(self, operation: Operation[RequestT, ReplyT], request: RequestT, token: str) -> httpx.Response:
        return await self.http.post(f"/api/v1/{operation.name}", content=msgspec.json.encode(request),
                                    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})

    async def ask(self, operation: Operation[RequestT, ReplyT], request: RequestT, token: str) -> ReplyT:
        """The operation's reply, which must be a 200 that decodes into its reply type."""
        response = await self.post(operation, request, token)
        assert response.status_code == 200, f"{operation.name}: {response.status_code} {response.text}"
        reply: ReplyT = msgspec.json.decode(response.content, type=operation.reply)
        self.answered.add(operation.name)
        return reply

    async def refused(self, operation: Operation[RequestT, ReplyT], request: RequestT, token: str) -> dict[str, Any]:
        """The problem a service answers a well-formed request with (not the gateway's refusal at its edge)."""
        response = await self.post(operation, request, token)
        assert response.headers["content-type"].startswith(PROBLEM), f"{operation.name}: {response.text}"
        problem: dict[str, Any] = response.json()
        assert problem["code"] in DOMAIN_CODES and 400 < response.status_code < 500, (operation.name, problem)
        return problem

    async def until(self, operation: Operation[RequestT, ReplyT], request: RequestT, token: str,
                    done: Callable[[ReplyT], bool], what: str, timeout: float = 30) -> ReplyT:
        """Ask again until the reply is `done`."""
        try:
            async with asyncio.timeout(timeout):
                while not done(reply := await self.ask(operation, request, token)):
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise AssertionError(f"{what}: not after {timeout:g}s") from None
        return reply

    async def follow(self, stream: str, params: dict[str, str], token: str,
                     last: Callable[[Event], bool] = lambda event: event.kind == "end") -> list[Event]:
        """The events of a follow stream until (and with) the `last` one; by default until it ends."""
        found: list[Event] = []
        async with self.http.stream("GET", f"/api/v1/follow/{stream}", params=params,
                                    headers={"Authorization": f"Bearer {token}"}) as response:
            assert response.status_code == 200, f"follow/{stream}: {(await response.aread()).decode()}"
            assert response.headers["content-type"].startswith("text/event-stream")
            async with asyncio.timeout(30):
                async for event in events(response):
                    found.append(event)
                    if event.kind == "error" or last(event):
                        break
        assert found and last(found[-1]), (stream, found)
        return found


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """A stream's events (comments passed over)."""
    kind, data = "message", b""
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield Event(kind, data)
            kind, data = "message", b""
        elif line.startswith("event:"):
            kind = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data += line.removeprefix("data:").strip().encode()


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(stack: Stack) -> AsyncIterator[HttpApi]:
    """The stack up, with its gateway answering."""
    await stack.up()
    async with httpx.AsyncClient(base_url=await stack.start_gateway(), timeout=30) as http:
        yield HttpApi(http)


def user_token(stack: Stack, user: str) -> str:
    secret = (stack.home / "auth-secret").read_text().strip()
    return issue_token(secret, Identity(user=user, projects=["default"]))


def logger(name: str) -> JobSpec:
    """A job on node-a that logs its loss every 0.1 s for minutes: it runs until stopped."""
    return JobSpec(name=name, flavors=["cpu-1"], node_names=["node-a"], algorithm=AlgorithmRef(name="metrics-logger"),
                   output=OutputRef(name=name), command="python3 log.py --steps 3000 --step-seconds 0.1")


def waiting(name: str) -> JobSpec:
    """A job of 9 nodes on a cluster of 2: it stays queued."""
    return msgspec.structs.replace(sleeper(name, nodes=2, seconds=300), nodes=9)


def tiny_image(folder: Path) -> Path:
    """The smallest archive the scheduler takes as an image: a root-filesystem tarball (libs/imagefiles.py)."""
    (folder / "rootfs" / "etc").mkdir(parents=True)
    (folder / "rootfs" / "etc" / "hostname").write_text("tiny\n")
    archive = folder / "tiny.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(folder / "rootfs" / "etc", arcname="etc")
    return archive


async def test_every_operation_people_send_answers_over_http(gateway: HttpApi, stack: Stack, tmp_path: Path) -> None:
    api, admin, alice = gateway, stack.token, user_token(stack, "alice")
    began = datetime.now(UTC)

    # Who is asking, and the platform's settings.
    me_admin = (await api.ask(cluster.WHOAMI, cluster.WhoAmI(), admin)).identity
    assert me_admin.admin
    me = (await api.ask(cluster.WHOAMI, cluster.WhoAmI(), alice)).identity
    assert (me.user, me.admin) == ("alice", False)
    before = (await api.ask(cluster.GET_SETTINGS, cluster.GetSettings(), admin)).settings
    changed = await api.ask(cluster.CHANGE_SETTINGS, cluster.ChangeSettings(debug_retention="2h"), admin)
    assert changed.settings.debug_retention == "2h" and changed.settings.urgent_cap == before.urgent_cap
    # The service itself refuses a person who is no administrator.
    assert (await api.refused(cluster.CHANGE_SETTINGS, cluster.ChangeSettings(urgent_cap=99), alice))["code"] == \
        "forbidden"

    # The cluster.
    flavors = await api.ask(cluster.LIST_FLAVORS, cluster.ListFlavors(), admin)
    assert {"cpu-1", "cpu-2"} <= {info.flavor.name for info in flavors.flavors}
    nodes = await api.ask(cluster.LIST_NODES, cluster.ListNodes(), admin)
    assert sorted(node.info.name for node in nodes.nodes) == ["node-a", "node-b"]
    resources = await api.ask(cluster.GET_RESOURCES, cluster.GetResources(flavors=["cpu-1"]), admin)
    assert {node.name for node in resources.nodes} == {"node-a", "node-b"}

    # Jobs: one that runs (and logs a metric), one that waits.
    predicted = await api.ask(planning.PREDICT_JOB, planning.PredictJob(spec=logger("running")), admin)
    assert predicted.prediction.starts_now
    running = (await api.ask(jobs.SUBMIT_JOB, jobs.SubmitJob(job_id=new_job_id(), spec=logger("running")),
                             admin)).job_id
    queued = await api.ask(jobs.SUBMIT_JOB, jobs.SubmitJob(job_id=new_job_id(), spec=waiting("waiting"),
                                                           predict=True), admin)
    assert queued.status == "queued" and queued.prediction is not None and not queued.prediction.starts_now
    await api.until(jobs.GET_JOB, jobs.GetJob(job_id=running), admin,
                    lambda details: details.job.status == "running" and bool(details.job.instances)
                    and all(instance.state == "running" for instance in details.job.instances), "the job running")
    await api.until(runs.GET_SERIES, runs.GetSeries(job_id=running, name="loss", rank=0), admin,
                    lambda page: bool(page.points), "the job's first points")

    listed = await api.ask(jobs.LIST_JOBS, jobs.ListJobs(), admin)
    assert {running, queued.job_id} <= {job.job_id for job in listed.jobs}
    # Another person of the project sees neither (they are not shared).
    assert not {running, queued.job_id} & {job.job_id for job in
                                           (await api.ask(jobs.LIST_JOBS, jobs.ListJobs(), alice)).jobs}
    line = await api.ask(jobs.GET_QUEUE, jobs.GetQueue(), admin)
    assert [job.job_id for job in line.jobs] == [queued.job_id]
    found = await api.ask(jobs.SEARCH_JOBS, jobs.SearchJobs(name="runn"), admin)
    assert [job.job_id for job in found.jobs] == [running]
    history = await api.ask(jobs.JOB_HISTORY, jobs.GetJobHistory(job_id=running), admin)
    assert "JobSubmitted" in {type(envelope.event).__name__ for envelope in history.events}
    logs = await api.until(jobs.JOB_LOGS, jobs.GetJobLogs(job_id=running), admin,
                           lambda page: any("started rank 0" in text for chunk in page.chunks for text in chunk.lines),
                           "the job's first log line")
    assert not logs.ended
    # A watch pushes into an inbox of one's own NATS connection (the gateway's follow streams use it); asked over
    # HTTP, it stands all the same.
    inbox = f"{inbox_prefix(user_nats_name(me_admin.user))}.watch-over-http"
    watching = await api.ask(watches.WATCH_JOB, watches.WatchJob(job_id=running, inbox=inbox, logs=True), admin)
    assert (watching.status, watching.since_now) == ("running", True)
    await api.ask(jobs.JOB_USAGE, jobs.GetJobUsage(job_id=running), admin)
    devenv = await api.ask(jobs.GET_DEV_ENV, jobs.GetDevEnv(job_id=running), admin)
    assert (devenv.source_job_id, devenv.flavor) == (running, "cpu-1")
    run = await api.ask(runs.GET_RUN, runs.GetRun(job_id=running), admin)
    assert run.state == "running" and "loss" in {series.name for series in run.series}
    why = await api.ask(planning.EXPLAIN_JOB, planning.ExplainJob(job_id=queued.job_id), admin)
    assert why.report.job_id == queued.job_id
    await api.ask(jobs.CHANGE_PRIORITY, jobs.ChangePriority(job_id=queued.job_id, priority="urgent"), admin)
    await api.ask(jobs.CHANGE_DURATION, jobs.ChangeDuration(job_id=running, duration="1h"), admin)
    assert (await api.ask(jobs.GET_JOB, jobs.GetJob(job_id=running), admin)).job.duration == "1h"
    clone = await api.ask(jobs.CLONE_JOB, jobs.CloneJob(source_job_id=queued.job_id, job_id=new_job_id(),
                                                        overrides={"name": "waiting-clone"}), admin)
    assert clone.created and clone.status == "queued"
    # A debug session in the running job: the agent starts `true` in it, which ends the session at once.
    opened = await api.ask(runs.OPEN_TERMINAL, runs.OpenTerminal(job_id=running, command="true"), admin)
    assert (opened.node, opened.rank) == ("node-a", 0)

    # An array of two jobs, each too large to start.
    array = await api.ask(arrays.SUBMIT_ARRAY, arrays.SubmitArray(
        array_id=new_array_id(), spec=msgspec.structs.replace(waiting("member"), name="member-{index}"),
        indices="0-1"), admin)
    assert len(array.job_ids) == 2
    details = await api.ask(arrays.GET_ARRAY, arrays.GetArray(array_id=array.array_id), admin)
    assert [member.index for member in details.jobs] == [0, 1]

    # Shared storage: alice registers a dataset to herself, and a copy of it is preloaded on a node.
    (stack.storage / "datasets" / DATASET).mkdir(parents=True)
    (stack.storage / "datasets" / DATASET / "part-0.txt").write_text("data\n")
    registered = await api.ask(cluster.SET_STORAGE_ACCESS, cluster.SetStorageAccess(
        kind="dataset", name=DATASET, project="default", others="read-only"), alice)
    assert [(entry.name, entry.owner) for entry in registered.entries] == [(DATASET, "alice")]
    mine = await api.ask(cluster.LIST_STORAGE_ACCESS, cluster.ListStorageAccess(kind="dataset"), alice)
    assert DATASET in {entry.name for entry in mine.entries}
    preload = await api.ask(cache.PRELOAD_DATASET, cache.PreloadDataset(
        preload_id=f"preload-{secrets.token_hex(6)}", name=DATASET, nodes=["node-a"]), admin)
    assert (preload.source, preload.nodes) == (f"datasets/{DATASET}", ["node-a"])
    await api.until(cache.LIST_CACHE, cache.ListCache(node="node-a"), admin,
                    lambda listing: any(entry.source == preload.source for node in listing.nodes
                                        for entry in node.entries), "the dataset in node-a's cache")

    # A component marked faulty raises an alert, which everyone may read (a node alert).
    await api.ask(cluster.MARK_COMPONENT, cluster.MarkComponent(node=FAULTY_NODE, component="runtime:storage",
                                                                reason="drill over http"), admin)
    page = await api.until(alerts.LIST_ALERTS, alerts.ListAlerts(), alice,
                           lambda page: any(alert_of(envelope).node == FAULTY_NODE for envelope in page.alerts),
                           "the node's alert")
    assert not page.more
    followed = await api.follow("alerts", {}, admin, lambda event: event.kind == "alert" and alert_of(
        msgspec.json.decode(event.data, type=EventEnvelope)).node == FAULTY_NODE)
    assert alert_of(msgspec.json.decode(followed[-1].data, type=EventEnvelope)).kind == "node-unhealthy"
    await api.ask(cluster.MARK_COMPONENT, cluster.MarkComponent(node=FAULTY_NODE, component="runtime:storage",
                                                                faulty=False), admin)

    # The autoscaler's view of demand (this cluster has no instance types: it only counts).
    status = await api.until(autoscaler.QUEUE_STATUS, autoscaler.GetQueueStatus(), admin,
                             lambda status: status.running_jobs == 1 and status.queued_jobs == 4,
                             "the autoscaler counting the jobs")
    assert status.instances == []
    await api.ask(autoscaler.AUTOSCALER_LOG, autoscaler.GetAutoscalerLog(), admin)

    # An image: uploaded, registered, found, unmarked for training, deleted.
    archive = tiny_image(tmp_path)
    upload_id = secrets.token_hex(16)
    received = await api.ask(images.UPLOAD_IMAGE, images.UploadImageChunk(
        upload_id=upload_id, offset=0, data=archive.read_bytes()), admin)
    assert received.received_bytes == archive.stat().st_size
    image = (await api.ask(images.REGISTER_IMAGE, images.RegisterImage(
        name=IMAGE_NAME, tag=IMAGE_TAG, upload_id=upload_id, digest=file_digest(archive), boards=["cpu"]),
        admin)).images[0]
    assert (image.format, image.training) == ("rootfs", True)
    assert [found.ref for found in (await api.ask(images.LIST_IMAGES, images.ListImages(), alice)).images] == \
        [image.ref]
    marked = await api.ask(images.MARK_IMAGE, images.MarkImage(ref=image.ref, training=False), admin)
    assert not marked.images[0].training
    await api.ask(images.DELETE_IMAGE, images.DeleteImage(ref=image.ref), admin)
    assert (await api.ask(images.LIST_IMAGES, images.ListImages(), admin)).images == []

    # Stopping: the running job, the waiting ones and the array's jobs.
    waiting_ids = [queued.job_id, clone.job_id]
    stopped = await api.ask(jobs.STOP_JOBS, jobs.StopJobs(
        job_ids=[running, *waiting_ids], arrays=[arrays.ArraySelection(array_id=array.array_id)]), admin)
    assert set(stopped.job_ids) == {running, *waiting_ids, *array.job_ids}
    await api.until(jobs.GET_JOB, jobs.GetJob(job_id=running), admin,
                    lambda details: details.job.status == "stopped", "the job stopped")

    # Each job stream of the ended job, to its end.
    chunks = [msgspec.json.decode(event.data, type=LogChunk)
              for event in await api.follow("logs", {"job_id": running}, admin) if event.kind == "log"]
    assert any("started rank 0" in text for chunk in chunks for text in chunk.lines)
    points = [msgspec.json.decode(event.data, type=SeriesPoint) for event in
              await api.follow("metrics", {"job_id": running, "name": "loss"}, admin)
              if event.kind == "point"]
    assert points and points[0].step == 0
    views = [msgspec.json.decode(event.data, type=JobView)
             for event in await api.follow("status", {"job_id": running}, admin) if event.kind == "status"]
    assert views and views[-1].status == "stopped"

    # What if: the test's own history replayed.
    report = await api.ask(planning.SIMULATE, planning.SimulateHistory(start=began), admin)
    assert report.jobs >= 1

    deleted = await api.ask(jobs.DELETE_JOBS, jobs.DeleteJobs(
        job_ids=[running, *waiting_ids], arrays=[arrays.ArraySelection(array_id=array.array_id)]), admin)
    assert set(deleted.job_ids) == {running, *waiting_ids, *array.job_ids}
    assert (await api.ask(jobs.SEARCH_JOBS, jobs.SearchJobs(), admin)).jobs == []

    assert api.answered == people_operations(), "operations people may send that were not sent here, or others"


def alert_of(envelope: EventEnvelope) -> AlertRaised:
    assert isinstance(envelope.event, AlertRaised), envelope
    return envelope.event

