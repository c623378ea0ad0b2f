"""Create TensorBoard in the console (seed 001, 批量任务创建 TensorBoard): a job's run downloaded as a zip of
TensorBoard event files, a run folder per task and rank as `trainyard tensorboard` writes them, read back as
TensorBoard reads them; and the dialog that explains it. Against the real scheduler and monitor on real NATS and
PostgreSQL: the scheduler's log has the jobs admitted on nodes n0 and n1, and the points are published on the
metrics stream as those nodes' agents would publish them."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import JobAdmitted, JobSubmitted, Placement
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import AlgorithmRef, BatchTask, JobSpec
from libs.contracts.runs import MetricBatch, MetricPoint
from libs.eventstore import NewEvent, OutboxRelay
from libs.skeleton.runtime import ServiceRuntime
from services.gateway.app import build_app
from services.gateway.connections import UserConnections
from services.gateway.console import tensorboard as page_module
from services.gateway.console.i18n import LANGUAGE_COOKIE
from services.gateway.sessions import SESSION_COOKIE, Sessions
from services.monitor.service import Monitor
from tests.support.monitor import start_monitor
from tests.support.schedulers import Schedulers, spec, token
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
LR_BATCH = 1000  # the points of one `lr` batch, an agent's largest
# The regular job's `loss`, each rank's: steps 0 to 9, and rank 0 logs step 5 again (the later value is written).
LOSS_0 = [(step, 10.0 - step * 0.5) for step in range(10)]
LOSS_1 = [(step, 20.0 - step) for step in range(10)]
RELOGGED_STEP_5 = 99.0


def lr_value(rank: int, index: int) -> float:
    return rank * 10_000 + index * 0.25  # exact as the float32 of an event file


@dataclass
class Jobs:
    regular: str  # alice's, read-only for project vision, two ranks on n0 and n1 logging `loss` and `lr`
    batch: str  # alice's batch job of two tasks, rank 0 of each logging `loss`
    quiet: str  # alice's, running, nothing logged
    rank_1_only: str  # alice's, only its rank 1 logged
    private: str  # alice's, access none, with points logged


@dataclass
class Site:
    http: httpx.AsyncClient
    sessions: Sessions
    jobs: Jobs

    async def get(self, path: str, user: str = "alice", *projects: str, language: str = "en") -> httpx.Response:
        """`path` as `user` (in `projects`, else vision) asks it, signed in to the console."""
        projects = projects or ("vision",)
        session_id, _ = self.sessions.open(token(user, *projects), Identity(user=user, projects=list(projects)))
        return await self.http.get(path, headers={"cookie": f"{SESSION_COOKIE}={session_id}; "
                                                            f"{LANGUAGE_COOKIE}={language}"})


async def admitted(store_of: StoreFactory, job_id: str, job_spec: JobSpec, nodes: int = 1) -> None:
    """The job as the scheduler's log has it: submitted by alice and admitted, rank r on node n<r>."""
    store = await store_of("scheduler")
    placement = [Placement(rank=rank, node=f"n{rank}", address=f"10.0.0.{rank + 1}", slots=1) for rank in range(nodes)]
    await store.append([NewEvent("job", job_id, JobSubmitted(job_id=job_id, spec=job_spec, creator="alice")),
                        NewEvent("job", job_id, JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1",
                                                            placement=placement))],
                       expected_versions={("job", job_id): 0})


def batch(job_id: str, rank: int, first_seq: int, points: Sequence[tuple[str, int | None, float]], *,
          task: int = 0) -> MetricBatch:
    return MetricBatch(job_id=job_id, attempt=1, task=task, rank=rank, node=f"n{rank}", process=f"pid-{rank}{task}",
                       points=[MetricPoint(seq=first_seq + offset, name=name, value=value,
                                           at=AT + timedelta(seconds=first_seq + offset), step=step)
                               for offset, (name, step, value) in enumerate(points)])


def lr_batch(job_id: str, rank: int, number: int, first_seq: int) -> MetricBatch:
    """The `number`th (from 0) batch of `lr`, logged without steps."""
    return batch(job_id, rank, first_seq, [("lr", None, lr_value(rank, number * LR_BATCH + index))
                                           for index in range(LR_BATCH)])


async def publish(nc: Client, batches: list[MetricBatch]) -> None:
    for number, published in enumerate(batches):
        await nc.jetstream().publish(subjects.job_metrics(published.job_id, published.node), encode(published),
                                     headers={"Nats-Msg-Id": f"{published.job_id}.{number}"})


def regular_run(job_id: str) -> list[MetricBatch]:
    """Both ranks' `loss`, then `lr` in the order two agents published it: rank 0's six batches and rank 1's two,
    rank 1's first published again after its agent restarted, among rank 0's batches. Read every rank at once, that
    copy comes on a later page than the first (the monitor takes a point once within a page)."""
    loss_0 = batch(job_id, 0, 1, [("loss", step, value) for step, value in LOSS_0] + [("loss", 5, RELOGGED_STEP_5)])
    loss_1 = batch(job_id, 1, 1, [("loss", step, value) for step, value in LOSS_1])
    lr_0 = [lr_batch(job_id, 0, number, 12 + number * LR_BATCH) for number in range(6)]
    lr_1 = [lr_batch(job_id, 1, number, 11 + number * LR_BATCH) for number in range(2)]
    return [loss_0, loss_1, lr_0[0], lr_1[0], lr_0[1], lr_0[2], lr_0[3], lr_0[4], lr_0[5], lr_1[0], lr_1[1]]


@pytest_asyncio.fixture(loop_scope="session")
async def site(nc: Client, nats_url: str, schedulers: Schedulers, make_store: StoreFactory) -> AsyncIterator[Site]:
    jobs = Jobs(regular=new_job_id(), batch=new_job_id(), quiet=new_job_id(), rank_1_only=new_job_id(),
                private=new_job_id())
    shared = {"project": "vision", "access": "read-only"}
    tasks = [BatchTask(algorithm=AlgorithmRef(name="algo"), command=f"python3 task{task}.py") for task in range(2)]
    await admitted(make_store, jobs.regular, spec("trained", nodes=2, **shared), nodes=2)
    await admitted(make_store, jobs.batch, spec("sweep", type="batch", tasks=tasks, **shared))
    await admitted(make_store, jobs.quiet, spec("quiet", **shared))
    await admitted(make_store, jobs.rank_1_only, spec("rank-1-only", nodes=2, **shared), nodes=2)
    await admitted(make_store, jobs.private, spec("private", project="vision", access="none"))
    relay = OutboxRelay(await make_store("scheduler"), nc.jetstream())
    while await relay.publish_pending():
        pass
    await schedulers.start()  # rebuilt from its log: it answers for the jobs
    monitor_runtime: ServiceRuntime
    monitor: Monitor
    monitor_runtime, monitor = await start_monitor(schedulers.settings)

    async def placed() -> bool:  # the monitor takes points only from the nodes a job was placed on
        known = [monitor.jobs.jobs.get(job_id) for job_id in vars(jobs).values()]
        return all(job is not None and "n0" in job.nodes_used for job in known)

    await eventually(placed)
    await publish(nc, regular_run(jobs.regular))
    await publish(nc, [batch(jobs.batch, 0, 1, [("loss", step, task + step * 0.5) for step in range(3)], task=task)
                       for task in range(2)])
    await publish(nc, [batch(jobs.rank_1_only, 1, 1, [("loss", 0, 1.0)])])
    await publish(nc, [batch(jobs.private, 0, 1, [("loss", 0, 1.0)])])

    connections = UserConnections(nats_url)
    sessions = Sessions()
    app = build_app(connections, sessions)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            yield Site(http, sessions, jobs)
    finally:
        await connections.close()
        await monitor_runtime.close()


def unzipped(answer: httpx.Response, job_id: str, into: Path) -> Path:
    """The download as a zip: checked to be one, with one top folder, unpacked under `into`; that folder."""
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/zip"
    assert answer.headers["content-disposition"] == f'attachment; filename="{job_id}-tensorboard.zip"'
    with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
        names = archive.namelist()
        assert {name.split("/", 1)[0] for name in names} == {f"{job_id}-tensorboard"}
        assert all(info.compress_type == zipfile.ZIP_DEFLATED for info in archive.infolist())
        archive.extractall(into)
    return into / f"{job_id}-tensorboard"


def runs_in(folder: Path) -> list[str]:
    """The TensorBoard runs under `folder`: the directories holding an event file, one each."""
    found = {}
    for event_file in folder.rglob("events.out.tfevents.*"):
        run = event_file.parent.relative_to(folder).as_posix()
        assert run not in found, f"two event files in {run}"
        found[run] = event_file
    return sorted(found)


def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard's event accumulator reads the run's directory."""
    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: every scalar, none sampled away
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def text_of(html: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', html, re.S)
    assert found, f"no #{element_id}"
    return " ".join(found.group(1).split())


async def test_the_download_holds_rank_0s_run_as_the_cli_writes_it(site: Site, tmp_path: Path) -> None:
    job_id = site.jobs.regular
    folder = unzipped(await site.get(f"/jobs/{job_id}/tensorboard.zip"), job_id, tmp_path)

    assert runs_in(folder) == ["rank-0"]
    [event_file] = (folder / "rank-0").iterdir()
    assert re.fullmatch(r"events\.out\.tfevents\.\d+\.trainyard", event_file.name)  # the gateway's host left out
    relogged = dict(LOSS_0) | {5: RELOGGED_STEP_5}
    assert scalars(folder / "rank-0", "loss") == sorted(relogged.items())
    # Six batches over two pages; logged without steps, numbered in the order they were logged.
    assert scalars(folder / "rank-0", "lr") == [(index, lr_value(0, index)) for index in range(6 * LR_BATCH)]


async def test_every_rank_is_a_run_of_its_own_and_each_point_is_taken_once(site: Site, tmp_path: Path) -> None:
    job_id = site.jobs.regular
    folder = unzipped(await site.get(f"/jobs/{job_id}/tensorboard.zip?all_ranks=1"), job_id, tmp_path)

    assert runs_in(folder) == ["rank-0", "rank-1"]
    assert scalars(folder / "rank-1", "loss") == LOSS_1
    # Rank 1's first batch, published twice, came again on a later page: its points are written once.
    assert scalars(folder / "rank-1", "lr") == [(index, lr_value(1, index)) for index in range(2 * LR_BATCH)]
    assert len(scalars(folder / "rank-0", "lr")) == 6 * LR_BATCH


async def test_a_batch_job_has_a_run_per_task_and_a_read_only_member_may_download_it(site: Site,
                                                                                      tmp_path: Path) -> None:
    job_id = site.jobs.batch
    folder = unzipped(await site.get(f"/jobs/{job_id}/tensorboard.zip", "bob", "vision"), job_id, tmp_path)

    assert runs_in(folder) == ["task-0/rank-0", "task-1/rank-0"]
    assert scalars(folder / "task-1" / "rank-0", "loss") == [(0, 1.0), (1, 1.5), (2, 2.0)]


async def test_the_dialog_says_what_the_download_holds_and_how_to_open_it(site: Site) -> None:
    job_id = site.jobs.regular
    answer = await site.get(f"/jobs/{job_id}/tensorboard", "bob", "vision")
    assert answer.status_code == 200, answer.text
    html = answer.text
    assert text_of(html, "dialog-title") == "Create TensorBoard"
    assert "trained" in text_of(html, "job-name")
    assert text_of(html, "outline-rank-0") == "2 series, 6,011 points"
    assert text_of(html, "outline-every") == "2 runs, 2 series, 8,021 points"
    assert f'action="/jobs/{job_id}/tensorboard.zip"' in html and 'id="download"' in html
    assert re.search(r'<input type="checkbox" name="all_ranks" value="1" id="all-ranks"\s*>', html)  # unchecked
    assert f"tensorboard --logdir {job_id}-tensorboard" in html
    assert text_of(html, "cli") == f"trainyard tensorboard {job_id}"

    checked = (await site.get(f"/jobs/{job_id}/tensorboard?all_ranks=1")).text
    assert re.search(r'id="all-ranks"\s*checked>', checked)
    assert text_of(checked, "cli") == f"trainyard tensorboard {job_id} --all-ranks"

    chinese = (await site.get(f"/jobs/{job_id}/tensorboard", language="zh-CN")).text
    assert text_of(chinese, "dialog-title") == "创建 TensorBoard"
    assert "下载" in text_of(chinese, "download")


async def test_a_job_without_metrics_says_there_is_nothing_to_show_yet(site: Site) -> None:
    job_id = site.jobs.quiet
    for path in (f"/jobs/{job_id}/tensorboard", f"/jobs/{job_id}/tensorboard.zip"):
        answer = await site.get(path)
        assert answer.status_code == (200 if path.endswith("tensorboard") else 409)
        assert answer.headers["content-type"].startswith("text/html")
        assert "no metrics yet" in text_of(answer.text, "nothing")
        assert 'id="download"' not in answer.text
    chinese = await site.get(f"/jobs/{job_id}/tensorboard.zip", language="zh-CN")
    assert "尚未记录任何指标" in text_of(chinese.text, "nothing")


async def test_rank_0_without_metrics_offers_the_other_ranks(site: Site, tmp_path: Path) -> None:
    job_id = site.jobs.rank_1_only
    answer = await site.get(f"/jobs/{job_id}/tensorboard.zip")
    assert answer.status_code == 409
    assert "Rank 0 logged no metrics" in text_of(answer.text, "rank-0-nothing")
    assert re.search(r'id="all-ranks"\s*checked>', answer.text)
    folder = unzipped(await site.get(f"/jobs/{job_id}/tensorboard.zip?all_ranks=1"), job_id, tmp_path)
    assert runs_in(folder) == ["rank-1"]


async def test_a_job_not_theirs_to_see_is_not_found_and_nothing_of_it_is_sent(site: Site) -> None:
    hidden, made_up = site.jobs.private, new_job_id()
    for user, projects in (("bob", ("vision",)), ("carol", ("nlp",))):
        for job_id in (hidden, made_up):
            for path in (f"/jobs/{job_id}/tensorboard", f"/jobs/{job_id}/tensorboard.zip"):
                answer = await site.get(path, user, *projects)
                assert answer.status_code == 404, path
                assert answer.headers["content-type"].startswith("text/html")
                assert "content-disposition" not in answer.headers and not answer.content.startswith(b"PK")
                assert text_of(answer.text, "refusal") == f"no such job: {job_id}"
                assert "private" not in answer.text
    assert (await site.get("/jobs/not-a-job/tensorboard.zip")).status_code == 404
    unsigned = await site.http.get(f"/jobs/{hidden}/tensorboard.zip")
    assert unsigned.status_code == 303 and unsigned.headers["location"].startswith("/signin")


async def test_a_run_too_large_to_download_is_refused_with_the_cli_to_use_instead(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = site.jobs.regular
    monkeypatch.setattr(page_module, "MOST_POINTS", 5_000)
    answer = await site.get(f"/jobs/{job_id}/tensorboard.zip")
    assert answer.status_code == 429 and not answer.content.startswith(b"PK")
    assert text_of(answer.text, "refusal") == "The run holds 6,011 points, more than the 5,000 a download may hold."
    assert f"trainyard tensorboard {job_id}" in answer.text
    assert "more than the 5,000 points a download may hold" in text_of(
        (await site.get(f"/jobs/{job_id}/tensorboard")).text, "too-large")
