"""L9 through the scheduler under J2: log pages and usage samples, on real NATS and PostgreSQL.

No agents run: the tests publish log chunks and usage samples the way an agent does, then read them
through the client as different users.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client

from client.api import TrainyardClient, TrainyardError
from libs.contracts import subjects
from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.codec import encode
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JOB_LOGS, GetJobLogs, LogPage
from libs.messaging.rpc import call
from tests.support.schedulers import Login, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def publish_chunk(nc: Client, job_id: str, rank: int, seq: int, lines: list[str], attempt: int = 1,
                        shipment: str = "") -> None:
    """A chunk as the rank's agent ships it; `shipment` tells a shipment made again outside the stream's duplicate
    window (two minutes later), which the stream stores again."""
    chunk = LogChunk(job_id=job_id, attempt=attempt, rank=rank, node=f"node-{rank}", seq=seq, lines=lines)
    await nc.jetstream().publish(subjects.node_logs(job_id, rank, chunk.node), encode(chunk),
                                 headers={"Nats-Msg-Id": f"{job_id}.{attempt}.0.{rank}.log.{seq}{shipment}"})


async def put_sample(nc: Client, job_id: str, attempt: int, rank: int, cpu: float = 50.0) -> None:
    kv = await nc.jetstream().key_value(subjects.USAGE_BUCKET)
    sample = UsageSample(job_id=job_id, attempt=attempt, rank=rank, node=f"node-{rank}", cpu_percent=cpu,
                         memory_mib=512, processes=2, sampled_at=datetime.now(UTC))
    await kv.put(subjects.usage_key(job_id, attempt, rank, sample.node), encode(sample))


async def page(client: TrainyardClient, request: GetJobLogs) -> LogPage:
    reply = await call(client.nc, JOB_LOGS.subject, request, token=client.token)
    assert isinstance(reply, LogPage), reply
    return reply


async def refused(call_: Awaitable[object]) -> CommandError:
    with pytest.raises(TrainyardError) as caught:
        await call_
    return caught.value.error


def lines_of(chunks: list[LogChunk]) -> list[str]:
    return [line for chunk in chunks for line in chunk.lines]


async def test_the_creator_reads_its_jobs_log_page_by_page_in_order(login: Login, nc: Client) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    other = (await alice.submit(spec("other"))).job_id
    for seq in range(12):  # two ranks interleaved, with another job's chunks between them
        await publish_chunk(nc, job, seq % 2, seq // 2, [f"line {seq}"])
        await publish_chunk(nc, other, 0, seq, [f"other {seq}"])

    pages, after = [], 0
    while True:
        reply = await page(alice, GetJobLogs(job_id=job, after=after, max_chunks=5))
        pages.append(reply)
        after = reply.next_after
        if not reply.more:
            break
    assert [len(p.chunks) for p in pages] == [5, 5, 2]
    assert [p.more for p in pages] == [True, True, False]
    assert lines_of([c for p in pages for c in p.chunks]) == [f"line {n}" for n in range(12)]
    assert not any(p.ended for p in pages)  # the job is still queued
    # Nothing stored after the last page: an empty page that stays where it was.
    assert await page(alice, GetJobLogs(job_id=job, after=after)) == LogPage(chunks=[], next_after=after,
                                                                             more=False, ended=False)

    # One rank; and through the client, all pages at once.
    rank1 = [c async for c in alice.logs(job, 1)]
    assert lines_of(rank1) == [f"line {n}" for n in range(1, 12, 2)]
    assert lines_of([c async for c in alice.logs(job)]) == [f"line {n}" for n in range(12)]
    assert [c async for c in alice.logs(other, 3)] == []


async def test_a_page_keeps_to_its_byte_budget_but_always_moves_on(login: Login, nc: Client) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    for seq in range(3):
        await publish_chunk(nc, job, 0, seq, [f"{seq}" * 700])
    first = await page(alice, GetJobLogs(job_id=job, max_bytes=1024))
    assert (len(first.chunks), first.more) == (1, True)  # one chunk is larger than half the budget
    second = await page(alice, GetJobLogs(job_id=job, after=first.next_after, max_bytes=1024))
    assert lines_of(second.chunks) == ["1" * 700]

    # A chunk as large as NATS takes does not fit in a reply beside the reply's own fields: its last lines
    # are left out, and a notice says so.
    huge = (await alice.submit(spec("huge"))).job_id
    line = "x" * 1000
    await publish_chunk(nc, huge, 0, 0, [line] * ((nc.max_payload - 2000) // 1003))
    [chunk] = (await page(alice, GetJobLogs(job_id=huge))).chunks
    assert chunk.lines[0] == line
    assert chunk.lines[-1].startswith("[trainyard] ") and "left out" in chunk.lines[-1]


async def test_only_those_who_may_view_the_job_read_its_logs_and_usage(login: Login, nc: Client) -> None:
    alice = await login("alice", "vision")
    member = await login("bob", "vision")
    outsider = await login("carol", "nlp")
    hidden = (await alice.submit(spec("hidden", project="vision", access="none"))).job_id
    shared = (await alice.submit(spec("shared", project="vision", access="read-only"))).job_id
    for job in (hidden, shared):
        await publish_chunk(nc, job, 0, 0, [f"{job} says hello"])
        await put_sample(nc, job, 1, 0)

    for reader, job in ((member, hidden), (outsider, hidden), (outsider, shared)):
        for error in (await refused(reader.logs(job).__anext__()), await refused(reader.usage(job))):
            assert (error.code, error.message) == ("not-found", f"no such job: {job}")

    assert lines_of([c async for c in member.logs(shared)]) == [f"{shared} says hello"]
    assert [s.job_id for s in await member.usage(shared)] == [shared]
    assert lines_of([c async for c in alice.logs(hidden)]) == [f"{hidden} says hello"]
    # Not found is not "no logs": an unknown id is refused the same way.
    assert (await refused(alice.usage("job-000000000000"))).code == "not-found"


async def test_usage_is_the_latest_sample_of_each_rank_of_the_latest_attempt(login: Login, nc: Client) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    other = (await alice.submit(spec("other"))).job_id
    assert await alice.usage(job) == []
    await put_sample(nc, job, 1, 0)
    await put_sample(nc, job, 1, 1)
    await put_sample(nc, job, 2, 1, cpu=10.0)
    await put_sample(nc, job, 2, 0, cpu=20.0)
    await put_sample(nc, job, 2, 0, cpu=30.0)  # replaces the one before
    await put_sample(nc, other, 3, 0)
    samples = await alice.usage(job)
    assert [(s.attempt, s.rank, s.cpu_percent) for s in samples] == [(2, 0, 30.0), (2, 1, 10.0)]


async def test_following_a_log_ends_once_the_job_has_ended(login: Login, nc: Client) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    await publish_chunk(nc, job, 0, 0, ["before"])
    seen: list[LogChunk] = []

    async def follow() -> None:
        async for chunk in alice.logs(job, follow=True, poll_seconds=0.1):
            seen.append(chunk)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await publish_chunk(nc, job, 0, 1, ["while queued"])
    await alice.stop([job])
    await asyncio.wait_for(follower, 60)
    assert lines_of(seen) == ["before", "while queued"]


async def test_a_bad_page_request_is_refused_by_field(login: Login) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    reply = await call(alice.nc, JOB_LOGS.subject, GetJobLogs(job_id=job, rank=-1), token=alice.token)
    assert isinstance(reply, CommandError)
    assert reply.code == "invalid-request"
    assert [e.field for e in reply.errors] == ["rank"]


async def test_a_chunk_its_agent_shipped_again_long_after_is_read_once(login: Login, nc: Client) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec())).job_id
    await publish_chunk(nc, job, 0, 0, ["first"])
    await publish_chunk(nc, job, 0, 1, ["second"])
    await publish_chunk(nc, job, 1, 0, ["rank 1"])
    # The agent of rank 0's node restarted after minutes down, not knowing its second chunk was stored.
    await publish_chunk(nc, job, 0, 1, ["second"], shipment=".again")
    await publish_chunk(nc, job, 0, 2, ["third"])
    stored = await page(alice, GetJobLogs(job_id=job))
    assert lines_of(stored.chunks) == ["first", "second", "rank 1", "second", "third"]  # the stream holds it twice
    assert lines_of([chunk async for chunk in alice.logs(job)]) == ["first", "second", "rank 1", "third"]
