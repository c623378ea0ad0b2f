"""R2: the monitor reads a job's run from the real metrics stream: its series in pages that follow on from
each other, each point once, only the job's own batches, and only for those who may view the job (J2)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import GetRun, GetSeries, RunView, SeriesPage, SeriesPoint
from libs.contracts.runs import MetricBatch, MetricPoint
from libs.jobstatus import JobLifecycle, JobRecord
from libs.messaging.connection import ensure_streams
from services.monitor.runs.reader import RunReader
from tests.support.specs import sleeper

pytestmark = pytest.mark.asyncio(loop_scope="session")
AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
ALICE = Identity(user="alice", projects=["vision"])


def batch(job_id: str, rank: int, first: int, count: int) -> MetricBatch:
    return MetricBatch(job_id=job_id, attempt=1, task=0, rank=rank, node=f"n{rank}", process="pid-7",
                       points=[MetricPoint(seq=seq, name="loss", value=1.0 / seq, at=AT, step=seq)
                               for seq in range(first, first + count)])


async def publish(nc: Client, job_id: str, batch: MetricBatch, msg_id: str, node: str | None = None) -> None:
    subject = subjects.job_metrics(job_id, node or batch.node)
    await nc.jetstream().publish(subject, encode(batch), headers={"Nats-Msg-Id": msg_id})


def reader(nc: Client, job_id: str) -> RunReader:
    jobs = JobLifecycle()
    spec = msgspec.structs.replace(sleeper("logger"), project="vision", access="none")
    jobs.jobs[job_id] = JobRecord(job_id=job_id, spec=spec, creator="alice", creator_email=None,
                                  nodes_used={"n0": None, "n1": None})  # where it was placed
    return RunReader(nc.jetstream(), jobs, {})


async def test_a_series_is_read_in_pages_that_follow_on_each_point_once(nc: Client) -> None:
    await ensure_streams(nc.jetstream())
    job_id, other = new_job_id(), new_job_id()
    for first in range(1, 3001, 100):  # 30 batches per rank, interleaved as two agents publish them
        for rank in (0, 1):
            await publish(nc, job_id, batch(job_id, rank, first, 100), f"{job_id}.{rank}.{first}")
    await publish(nc, job_id, batch(job_id, 0, 2951, 100), f"{job_id}.0.again")  # after an agent restart
    await publish(nc, other, batch(other, 0, 1, 100), f"{other}.0.1")
    # What no agent of the job's nodes published: the agent of a node it never ran on, and one that names
    # another node than its own subject (NATS lets each agent publish only its own node's subject).
    stranger = msgspec.structs.replace(batch(job_id, 0, 1, 100), node="n9", process="forger")
    await publish(nc, job_id, stranger, f"{job_id}.forged.1")
    await publish(nc, job_id, batch(job_id, 1, 5001, 100), f"{job_id}.forged.2", node="n0")

    runs = reader(nc, job_id)
    pages: list[SeriesPage] = []
    after, points = 0, list[SeriesPoint]()
    while True:
        page = await runs.series(GetSeries(job_id=job_id, name="loss", rank=0, after=after, limit=700), ALICE)
        assert isinstance(page, SeriesPage)
        pages.append(page)
        points += page.points
        after = page.next_after
        if not page.more:
            break
    assert len(pages) > 3 and all(len(p.points) <= 800 for p in pages)  # a page ends on a batch's end
    # Every point of rank 0 once and in order; the batch published again adds 50 new points past 3,000.
    assert [p.seq for p in points] == list(range(1, 3051))
    assert {(p.rank, p.process, p.attempt, p.node) for p in points} == {(0, "pid-7", 1, "n0")}

    view = await runs.run(GetRun(job_id=job_id), ALICE)
    assert isinstance(view, RunView) and view.state == "waiting"
    assert [(s.rank, s.count, s.last_step) for s in view.series] == [(0, 3050, 3050), (1, 3000, 3000)]
    assert [(p.rank, p.points) for p in view.processes] == [(0, 3050), (1, 3000)]


async def test_a_run_is_read_only_by_those_who_may_view_the_job(nc: Client) -> None:
    await ensure_streams(nc.jetstream())
    job_id = new_job_id()
    runs = reader(nc, job_id)
    mallory = Identity(user="mallory", projects=["nlp"])
    made_up = new_job_id()
    for read in (lambda job: runs.run(GetRun(job_id=job), mallory),
                 lambda job: runs.series(GetSeries(job_id=job, name="loss"), mallory)):
        hidden, missing = await read(job_id), await read(made_up)  # J2: a hidden job is a missing one
        assert isinstance(hidden, CommandError) and isinstance(missing, CommandError)
        assert hidden.code == "not-found" and hidden == msgspec.structs.replace(
            missing, message=missing.message.replace(made_up, job_id))
    empty = await runs.series(GetSeries(job_id=job_id, name="loss"), ALICE)  # nothing logged yet
    assert isinstance(empty, SeriesPage) and empty.points == [] and not empty.more
