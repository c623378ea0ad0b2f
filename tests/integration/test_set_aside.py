"""Forged and poisoned upstream messages are set aside, recorded once, and never stall a follower;
a database that is away is waited for instead (real NATS and PostgreSQL, a raw NATS publisher)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import TypeVar

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from client.api import TrainyardClient
from libs.contracts import subjects
from libs.contracts.agent import ProcessStarted
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobDurationChanged,
    JobStopped,
    JobSucceeded,
    LaunchSucceeded,
    NodeRecovered,
    NodeRegistered,
    UpstreamMessageSetAside,
)
from libs.eventstore import EventStore, NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from services.scheduler.service import Scheduler
from tests.support.reactor import Reactor
from tests.support.schedulers import Schedulers, spec, token
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")



async def publish(nc: Client, subject: str, *, service: str, aggregate_type: str, aggregate_id: str, event: Event,
                  version: int = 1) -> None:
    """What a raw NATS client can publish: any envelope, on any subject."""
    envelope = EventEnvelope(event_id=str(uuid.uuid4()), service=service, aggregate_type=aggregate_type,
                             aggregate_id=aggregate_id, version=version, position=1, recorded_at=datetime.now(UTC),
                             event=event)
    await nc.jetstream().publish(subject, encode(envelope))


async def set_aside(store: EventStore) -> list[UpstreamMessageSetAside]:
    return [e.event async for e in store.read_all() if isinstance(e.event, UpstreamMessageSetAside)]


# --- the follower on its own ---------------------------------------------------------------------------


async def stopped(nc: Client, job_id: str) -> None:
    await publish(nc, subjects.event_subject("scheduler", "job", "JobStopped"), service="scheduler",
                  aggregate_type="job", aggregate_id=job_id, event=JobStopped(job_id=job_id, by="bob"))


async def follow(nc: Client, store: EventStore, reactor: Reactor, expected: int) -> StreamFollower:
    follower = StreamFollower(nc.jetstream(), store, stream=subjects.EVENTS_STREAM,
                              subject=subjects.events_of_service("scheduler"), consumer="scheduler-events",
                              message_type=EventEnvelope, handle=reactor.handle, retry_seconds=0.01)
    await follower.start()
    await asyncio.wait_for(follower.caught_up.wait(), 60)
    await eventually(lambda: _at_least(reactor.folded, expected))
    return follower


async def _at_least(items: list[str], count: int) -> bool:
    return len(items) >= count


async def test_garbage_and_forgeries_are_set_aside_and_the_follower_goes_on(nc: Client,
                                                                           make_store: StoreFactory) -> None:
    store = await make_store("launcher")
    await stopped(nc, "g0")
    await nc.jetstream().publish(subjects.event_subject("scheduler", "job", "JobStopped"), b"\x00garbage{")
    # Claims the monitor, on the scheduler's subject; then a job event on another event's subject.
    await publish(nc, subjects.event_subject("scheduler", "job", "JobStopped"), service="monitor",
                  aggregate_type="job", aggregate_id="g2", event=JobStopped(job_id="g2", by="mallory"))
    await publish(nc, subjects.event_subject("scheduler", "job", "JobSucceeded"), service="scheduler",
                  aggregate_type="job", aggregate_id="g3", event=JobStopped(job_id="g3", by="mallory"))
    await stopped(nc, "g4")
    reactor = Reactor(store)
    follower = await follow(nc, store, reactor, expected=2)
    await follower.stop()

    assert reactor.folded == ["g0", "g4"]
    records = await set_aside(store)
    assert [(r.sequence, r.cause) for r in records] == [(2, "undecodable"), (3, "inconsistent"), (4, "inconsistent")]
    assert records[1].claimed_service == "monitor" and records[1].claimed_type == "JobStopped.v1"
    assert await store.tracked_position("scheduler-events") == 5

    # On the next start they are replayed, passed over again, and not recorded twice.
    again = Reactor(store)
    follower = await follow(nc, store, again, expected=2)
    await follower.stop()
    assert again.folded == ["g0", "g4"]
    assert len(await set_aside(store)) == 3


async def test_a_reaction_in_conflict_is_set_aside_and_later_messages_are_processed(
        nc: Client, make_store: StoreFactory) -> None:
    store = await make_store("launcher")
    for job_id in ("c0", "c1", "c2"):
        await stopped(nc, job_id)
    # Another writer got to c1's aggregate first: the reaction's append at version 0 conflicts.
    await store.append([NewEvent("node", "c1", NodeRecovered(node_name="n"))], expected_versions={("node", "c1"): 0})
    reactor = Reactor(store)
    follower = await follow(nc, store, reactor, expected=3)
    await eventually(lambda: _tracked(store, 3))
    await follower.stop()

    [record] = await set_aside(store)
    assert (record.sequence, record.cause, record.claimed_type) == (2, "conflict", "JobStopped.v1")
    reacted = [e.aggregate_id async for e in store.read_all() if e.aggregate_type == "node"]
    assert reacted == ["c1", "c0", "c2"]  # the other writer's, then the reactions to c0 and c2


async def _tracked(store: EventStore, position: int) -> bool:
    return await store.tracked_position("scheduler-events") >= position


async def test_a_database_outage_is_waited_for_not_set_aside(nc: Client, make_store: StoreFactory) -> None:
    store = await make_store("launcher")
    for job_id in ("d0", "d1", "d2"):
        await stopped(nc, job_id)
    reactor = Reactor(store)
    reactor.outages["d1"] = 6  # more failures in a row than an unknown error is given
    follower = await follow(nc, store, reactor, expected=3)
    await eventually(lambda: _tracked(store, 3))
    await follower.stop()

    assert reactor.folded == ["d0", "d1", "d2"]
    assert await set_aside(store) == []
    assert [e.aggregate_id async for e in store.read_all()] == ["d0", "d1", "d2"]


# --- the scheduler --------------------------------------------------------------------------------------


async def _status(client: TrainyardClient, job_id: str, status: str) -> bool:
    return (await client.get_job(job_id)).job.status == status


async def test_the_scheduler_sets_aside_forged_and_conflicting_events_and_still_ends_later_jobs(
        schedulers: Schedulers, nc: Client, nats_url: str, make_store: StoreFactory) -> None:
    await schedulers.start()
    scheduler: Scheduler = schedulers.started[-1]
    client = await TrainyardClient.open(nats_url, token=token("alice"))
    try:
        # A node, as the monitor publishes it, so that jobs run.
        node = NodeInfo(name="node-a", address="127.0.0.1", cpus=8, memory_mib=16384)
        await publish(nc, subjects.event_subject("monitor", "node", "NodeRegistered"), service="monitor",
                      aggregate_type="node", aggregate_id="node-a", event=NodeRegistered(node=node))
        first = (await client.submit(spec("first"))).job_id
        second = (await client.submit(spec("second"))).job_id
        for job_id in (first, second):
            await eventually(lambda job_id=job_id: _status(client, job_id, "running"))  # type: ignore[misc]

        # (a) A JobSucceeded claiming the scheduler, published on a monitor subject, changes nothing.
        await publish(nc, subjects.event_subject("monitor", "job", "JobSucceeded"), service="scheduler",
                      aggregate_type="job", aggregate_id=first, event=JobSucceeded(job_id=first), version=9)
        # (c) Garbage on a followed subject.
        await nc.jetstream().publish(subjects.event_subject("launcher", "launch", "LaunchSucceeded"), b"]]")
        # (b) Another writer moved the first job on: the scheduler's answer to its launch outcome conflicts.
        other_writer = await make_store("scheduler")
        version = scheduler.version("job", first)
        await other_writer.append([NewEvent("job", first, JobDurationChanged(job_id=first, duration="1h",
                                                                             by="mallory"))],
                                  expected_versions={("job", first): version})
        # One launch outcome at a time: two that arrive together are decided in one run, and a run that conflicts
        # is decided again message by message once the other writer's event is folded (then nothing conflicts).
        await publish(nc, subjects.event_subject("launcher", "launch", "LaunchSucceeded"),
                      service="launcher", aggregate_type="launch", aggregate_id=first,
                      event=LaunchSucceeded(job_id=first, attempt=1))
        records = await eventually(lambda: _count(set_aside(other_writer), 3))
        await publish(nc, subjects.event_subject("launcher", "launch", "LaunchSucceeded"),
                      service="launcher", aggregate_type="launch", aggregate_id=second,
                      event=LaunchSucceeded(job_id=second, attempt=1))

        # The later job still ends; the forged and the conflicting messages were set aside, once each.
        await eventually(lambda: _status(client, second, "succeeded"))
        assert sorted((r.consumer, r.cause) for r in records) == [
            ("launcher-events", "conflict"), ("launcher-events", "undecodable"), ("monitor-events", "inconsistent")]
        forged = next(r for r in records if r.cause == "inconsistent")
        assert (forged.claimed_service, forged.claimed_type) == ("scheduler", "JobSucceeded.v1")
        assert (await client.get_job(first)).job.status == "running"
        assert scheduler.state.jobs[first].status == "running"
        # After the conflict the scheduler folded what the other writer recorded: its next decision sees it.
        assert scheduler.version("job", first) == version + 1
        assert scheduler.state.jobs[first].duration == "1h"
    finally:
        await client.close()


async def _count(found: Awaitable[list[T]], count: int) -> list[T]:
    items = await found
    return items if len(items) >= count else []


async def test_a_report_its_sender_could_not_have_sent_is_set_aside_once(nc: Client, make_store: StoreFactory) -> None:
    store = await make_store("launcher")
    js = nc.jetstream()
    for subject, node in ((subjects.agent_report("node-a"), "node-a"), (subjects.agent_report("node-b"), "node-a"),
                          (subjects.agent_report("node-b"), "node-b")):
        await js.publish(subject, encode(ProcessStarted(job_id="job-000000000001", attempt=1, rank=0, node=node,
                                                        pid=1)))
    taken: list[str] = []

    async def handle(report: ProcessStarted, _: Msg, tracking: Tracking | None) -> bool:
        taken.append(report.node)
        return False

    async def follow_reports() -> None:
        follower = StreamFollower(js, store, stream=subjects.AGENT_REPORTS_STREAM, subject=subjects.AGENT_REPORTS_ALL,
                                  consumer="agent-reports", message_type=ProcessStarted, handle=handle,
                                  retry_seconds=0.01,
                                  check=lambda report, subject: subjects.sender_refusal(subject, report.node))
        await follower.start()
        await asyncio.wait_for(follower.caught_up.wait(), 60)
        await eventually(lambda: _at_least(taken, 2))
        await follower.stop()

    await follow_reports()
    assert taken == ["node-a", "node-b"]
    [record] = await set_aside(store)
    assert (record.sequence, record.cause, record.subject) == (2, "inconsistent", subjects.agent_report("node-b"))
    assert record.reason == f"published by node node-b on {subjects.agent_report('node-b')} but it names node node-a"
    assert record.claimed_type == "ProcessStarted.v1"

    # Replayed on the next start: passed over again, not recorded twice.
    taken.clear()
    await follow_reports()
    assert taken == ["node-a", "node-b"]
    assert len(await set_aside(store)) == 1
