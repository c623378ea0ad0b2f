"""`watch-job` against a real monitor and scheduler on real NATS: a person is pushed a job's changes and new log
chunks into an inbox of their own connection, each chunk naming the one before it, until the watch ends; an inbox
that is not the caller's own is refused."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from client.api import TrainyardError
from libs.contracts import subjects
from libs.contracts.agent import LogChunk
from libs.contracts.codec import decode_any, encode
from libs.contracts.operations.watches import WATCH_JOB, JobChanged, JobPush, LogPushed, Watching, WatchJob
from tests.support.monitor import start_monitor
from tests.support.schedulers import Schedulers, logins, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def publish_chunk(nc: Client, job_id: str, seq: int) -> None:
    chunk = LogChunk(job_id=job_id, attempt=1, rank=0, node="node-0", seq=seq, lines=[f"line {seq}"])
    await nc.jetstream().publish(subjects.node_logs(job_id, 0, "node-0"), encode(chunk),
                                 headers={"Nats-Msg-Id": f"{job_id}.1.0.0.log.{seq}"})


async def pushed(inbox: asyncio.Queue[Msg], kind: type[JobPush], seconds: float = 10.0) -> JobPush:
    """The next push of `kind`; those of the other kind are passed over (the job's prediction, folded meanwhile)."""
    async with asyncio.timeout(seconds):
        while True:
            push = decode_any((await inbox.get()).data, JobPush)
            if isinstance(push, kind):
                return push


async def test_a_watch_pushes_changes_and_chunks_until_it_ends(schedulers: Schedulers, nats_url: str,
                                                               nc: Client) -> None:
    await schedulers.start()
    runtime, _ = await start_monitor(schedulers.settings)
    try:
        async with logins(nats_url) as login:
            alice = await login("alice")
            job_id = (await alice.submit(spec())).job_id
            received: asyncio.Queue[Msg] = asyncio.Queue()
            inbox = alice.nc.new_inbox()
            await alice.nc.subscribe(inbox, cb=received.put)

            async def watch(**changes: bool) -> Watching:
                while True:  # the monitor folds the submission a moment after the scheduler answered it
                    try:
                        return await alice.ask(WATCH_JOB, WatchJob(job_id=job_id, inbox=inbox, **changes))
                    except TrainyardError as exc:
                        assert exc.error.code == "not-found"
                        await asyncio.sleep(0.05)

            watching = await watch(logs=True)
            assert (watching.status, watching.since_now, watching.last_log) == ("queued", True, None)
            for seq in range(3):
                await publish_chunk(nc, job_id, seq)
            chunks = [await pushed(received, LogPushed) for _ in range(3)]
            logs = [push for push in chunks if isinstance(push, LogPushed)]
            assert [push.chunk.lines for push in logs] == [["line 0"], ["line 1"], ["line 2"]]
            assert [push.previous for push in logs] == [None, logs[0].position, logs[1].position]
            renewed = await watch(logs=True)
            assert (renewed.since_now, renewed.last_log) == (False, logs[2].position)

            await alice.stop([job_id])
            changed = await pushed(received, JobChanged)
            while changed == JobChanged(job_id=job_id, status="queued"):
                changed = await pushed(received, JobChanged)
            assert changed == JobChanged(job_id=job_id, status="stopped")

            ended = await watch(end=True)
            assert ended.seconds == 0
            await publish_chunk(nc, job_id, 3)
            with pytest.raises(TimeoutError):
                await pushed(received, LogPushed, 1.0)
    finally:
        await runtime.close()


async def test_pushes_go_only_into_the_callers_own_inbox(schedulers: Schedulers, nats_url: str) -> None:
    await schedulers.start()
    runtime, _ = await start_monitor(schedulers.settings)
    try:
        async with logins(nats_url) as login:
            alice, bob = await login("alice"), await login("bob")
            job_id = (await alice.submit(spec(access="read-only"))).job_id
            for inbox in (bob.nc.new_inbox(), "_INBOX.anonymous.reply", "_INBOX.monitor.x"):
                while True:
                    try:
                        await alice.ask(WATCH_JOB, WatchJob(job_id=job_id, inbox=inbox))
                    except TrainyardError as exc:
                        if exc.error.code == "not-found":  # not folded yet
                            await asyncio.sleep(0.05)
                            continue
                        assert exc.error.code == "forbidden" and "inbox" in exc.error.message, inbox
                        break
                    raise AssertionError(f"a watch pushing into {inbox} was taken")
    finally:
        await runtime.close()
