"""Reactions to a run of upstream messages decided together (`Upstream.key`): recorded in few appends, each
message still answered once and on a view holding everything recorded for its own key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
import pytest_asyncio
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.events import EventEnvelope, NodeRecovered
from libs.eventstore import EventStore, NewEvent, Tracking
from libs.messaging.follower import Arrival
from libs.skeleton.eventsourced import EventSourcedService, Upstream, aggregate_of
from libs.skeleton.runtime import ServiceRuntime
from tests.support.stores import StoreFactory
from tests.support.upstream import followed, publish_upstream

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    return await make_store("launcher")


class CountingAppends:
    """The real store, counting the appends that carry events."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.appends = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def append(self, changes: Sequence[NewEvent], **kwargs: Any) -> Any:
        self.appends += 1
        return await self.store.append(changes, **kwargs)


class Answering(EventSourcedService):
    """Answers each job's n-th message with an event on `node/<job>-<n>`, n read from what it recorded for the
    job so far: a reaction decided on a view missing the job's earlier answer would write `<job>-0` twice."""

    name = "launcher"

    def __init__(self, runtime: ServiceRuntime, fail_once: str | None = None) -> None:
        super().__init__(runtime)
        self.answered: dict[str, int] = {}
        self.seen: list[str] = []
        self.fail_once = fail_once

    def fold(self, envelope: EventEnvelope) -> None:
        job = envelope.aggregate_id.rsplit("-", 1)[0]
        self.answered[job] = self.answered.get(job, 0) + 1

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of_service("scheduler"),
                         consumer="scheduler-events", message_type=EventEnvelope, fold=self.note,
                         react=self.answer, key=aggregate_of)]

    def note(self, envelope: EventEnvelope) -> None:
        self.seen.append(envelope.aggregate_id)

    def answer(self, envelope: EventEnvelope) -> list[NewEvent]:
        job = envelope.aggregate_id
        if job == self.fail_once:
            self.fail_once = None
            raise RuntimeError("a passing failure")
        name = f"{job}-{self.answered.get(job, 0)}"
        return [NewEvent("node", name, NodeRecovered(node_name=name))]




async def run(nc: Client, store: CountingAppends, expected: int, fail_once: str | None = None, *,
              kind: type[Answering] = Answering) -> Answering:
    runtime = cast(ServiceRuntime, SimpleNamespace(js=nc.jetstream(), store=store))
    return await followed(kind(runtime, fail_once), cast(EventStore, store), expected)


async def answers(store: EventStore) -> list[str]:
    return [envelope.aggregate_id async for envelope in store.read_all()]


async def test_a_burst_is_answered_in_few_appends_each_message_once_and_in_order(nc: Client,
                                                                                 store: EventStore) -> None:
    jobs = [f"j{i}" for i in range(30)]
    await publish_upstream(nc, jobs + jobs)  # each job twice: its second answer must see its first
    counting = CountingAppends(store)
    service = await run(nc, counting, expected=60)

    assert service.seen == jobs + jobs
    assert await answers(store) == [f"{job}-0" for job in jobs] + [f"{job}-1" for job in jobs]
    assert counting.appends <= 20  # one a message would be 60
    assert await store.tracked_position("scheduler-events") == 60

    again = CountingAppends(store)  # a restart folds it all again and answers nothing twice
    restarted = await run(nc, again, expected=60)
    assert restarted.seen == jobs + jobs
    assert again.appends == 0
    assert restarted.answered == {job: 2 for job in jobs}


class AnsweringAfter(Answering):
    """Answering, its rule also given the answers waiting for the job in the run (`Upstream.react_after`)."""

    runs = 0  # the runs of messages decided together

    def upstreams(self) -> Sequence[Upstream]:
        return [replace(upstream, react_after=self.answer_after) for upstream in super().upstreams()]

    def answer_after(self, envelope: EventEnvelope, waiting: Sequence[NewEvent]) -> list[NewEvent]:
        name = f"{envelope.aggregate_id}-{self.answered.get(envelope.aggregate_id, 0) + len(waiting)}"
        return [NewEvent("node", name, NodeRecovered(node_name=name))]

    async def on_upstream_group(self, upstream: Upstream, arrivals: Sequence[Arrival]) -> Tracking | None:
        self.runs += 1
        return await super().on_upstream_group(upstream, arrivals)


async def test_a_rule_that_sees_the_answers_waiting_for_its_job_records_a_whole_run_in_one_append(
        nc: Client, store: EventStore) -> None:
    jobs = [f"a{i}" for i in range(30)]
    await publish_upstream(nc, [job for job in jobs for _ in range(2)])  # each job's two messages together
    counting = CountingAppends(store)
    service = await run(nc, counting, expected=60, kind=AnsweringAfter)
    assert isinstance(service, AnsweringAfter)

    assert await answers(store) == [f"{job}-{n}" for job in jobs for n in range(2)]  # the second after the first
    assert await store.tracked_position("scheduler-events") == 60
    assert counting.appends <= service.runs  # never cut at a job's second message: one append a run
    assert counting.appends < 30


async def test_a_run_that_fails_part_way_is_answered_one_message_at_a_time_nothing_lost_or_doubled(
        nc: Client, store: EventStore) -> None:
    jobs = [f"k{i}" for i in range(20)]
    await publish_upstream(nc, jobs)
    await run(nc, CountingAppends(store), expected=20, fail_once="k12")
    assert await answers(store) == [f"{job}-0" for job in jobs]
    assert await store.tracked_position("scheduler-events") == 20


async def test_the_last_position_is_written_when_no_message_of_a_run_needed_an_answer(
        nc: Client, store: EventStore) -> None:
    class Silent(Answering):
        def answer(self, envelope: EventEnvelope) -> list[NewEvent]:
            return []

    await publish_upstream(nc, [f"s{i}" for i in range(10)])
    runtime = cast(ServiceRuntime, SimpleNamespace(js=nc.jetstream(), store=store))
    service = Silent(runtime)
    follower = service.follower(service.upstreams()[0])
    await follower.start()
    await asyncio.wait_for(follower.caught_up.wait(), 60)
    await follower.stop()  # writes the position left unwritten
    assert service.seen == [f"s{i}" for i in range(10)]
    assert await store.tracked_position("scheduler-events") == 10
    assert await answers(store) == []
