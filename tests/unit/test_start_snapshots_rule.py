"""When a snapshot of a live state may be taken, and what it says it holds (libs/skeleton/snapshots.py): never a
message folded whose reaction is not recorded yet, nor while an append is under way; per subject filter, what its
follower handled whole or what the state it started from held; of the streams as they were made."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest

from libs.contracts.events import EventEnvelope, JobStopped, NodeRecovered
from libs.eventstore import NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.skeleton import snapshots
from libs.skeleton.eventsourced import EventSourcedService, Upstream
from libs.skeleton.runtime import ServiceRuntime
from libs.skeleton.snapshots import FollowedNow, Taken, upstream_positions
from tests.support.eventlog import EventLog, fake_runtime

JOBS = "trainyard.events.scheduler.job.>"
SETTINGS = "trainyard.events.scheduler.settings.>"
REPORTS = "trainyard.agent-reports.>"


def test_a_state_holds_what_each_follower_handled_whole() -> None:
    followed = [FollowedNow("scheduler-events", 40, {JOBS: 40, SETTINGS: 40}),
                FollowedNow("agent-reports", 7, {REPORTS: 7})]
    assert upstream_positions(followed, {"scheduler-events": 40, "agent-reports": 3}) == {
        JOBS: 40, SETTINGS: 40, REPORTS: 7}
    assert upstream_positions(followed, {}) == {JOBS: 40, SETTINGS: 40, REPORTS: 7}


def test_no_snapshot_while_a_message_folded_waits_for_its_reaction() -> None:
    """A message whose fold began after the last one its follower handled whole (a reaction calling out, a retry
    pending, a run broken part-way) may be in the state unanswered: nothing is taken."""
    followed = [FollowedNow("scheduler-events", 40, {JOBS: 40}), FollowedNow("agent-reports", 7, {REPORTS: 7})]
    assert upstream_positions(followed, {"agent-reports": 8}) is None


def test_a_filter_that_cannot_be_followed_part_way_is_replayed_when_only_reacted_to() -> None:
    """The monitor's follower of every service's set-aside records (`a.*.b`) only reacts: after a restore it replays
    them, answering none twice. A follower that folds such a filter into the state makes it unsaveable."""
    set_aside = "trainyard.events.*.upstream.*.UpstreamMessageSetAside"
    followed = [FollowedNow("scheduler-events", 40, {JOBS: 40}), FollowedNow("set-aside-events", 9, {set_aside: 9},
                                                                             stateless=True)]
    assert upstream_positions(followed, {}) == {JOBS: 40}
    with pytest.raises(snapshots.Unsaveable):
        upstream_positions([FollowedNow("set-aside-events", 9, {set_aside: 9})], {})


def follower(folded: dict[str, int] | None = None) -> StreamFollower:
    async def handle(*_: Any) -> bool:
        return False

    return StreamFollower(cast(Any, None), cast(Any, None), stream="TRAINYARD_EVENTS", subject=[JOBS, SETTINGS],
                          consumer="scheduler-events", message_type=EventEnvelope, handle=handle, folded=folded)


def test_a_follower_tells_per_filter_what_it_handled_or_its_state_began_with() -> None:
    fresh = follower()
    assert fresh.positions() == {JOBS: 0, SETTINGS: 0}
    fresh.through = 12
    assert fresh.positions() == {JOBS: 12, SETTINGS: 12}
    restored = follower({JOBS: 100, SETTINGS: 50})
    restored.through = 70  # a settings message past 50 handled; the jobs' up to 100 were in the state already
    assert restored.positions() == {JOBS: 100, SETTINGS: 70}


def test_a_snapshot_is_of_the_streams_as_they_were_made() -> None:
    born = snapshots.stream_born(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert snapshots.streams_unchanged({"TRAINYARD_EVENTS": born}, {"TRAINYARD_EVENTS": born, "OTHER": "x"})
    assert not snapshots.streams_unchanged({"TRAINYARD_EVENTS": born}, {"TRAINYARD_EVENTS": "2027-01-01"})
    assert not snapshots.streams_unchanged({"TRAINYARD_EVENTS": ""}, {"TRAINYARD_EVENTS": ""})  # not told: unknown
    assert snapshots.stream_born(None) == ""


def test_versions_and_data_come_back_as_saved() -> None:
    versions = {("launch", "job-000000000001"): 7, ("upstream", "agent-reports-12"): 1}
    assert snapshots.decode_versions(snapshots.encode_versions(versions)) == versions
    assert snapshots.decompress(snapshots.compress(b"state" * 1000)) == b"state" * 1000


def test_the_format_changes_with_the_code() -> None:
    one = snapshots.code_format(("libs/skeleton/snapshots.py",))
    assert one == snapshots.code_format(("libs/skeleton/snapshots.py",)) and len(one) == 16
    assert one != snapshots.code_format(("libs/skeleton/snapshots.py", "libs/jobstatus.py"))


# --- the base: taken under the lock, at a moment when nothing folded waits for its reaction -------------------------


class Counting(EventSourcedService):
    """Counts the scheduler's stops and answers each with an event of its own; its fold fails while `failing`."""

    name = "launcher"
    snapshot_code = ("libs/skeleton/snapshots.py",)

    def __init__(self, runtime: ServiceRuntime) -> None:
        super().__init__(runtime)
        self.stops = 0
        self.failing = False

    def save_state(self) -> bytes:
        return str(self.stops).encode()

    def fold(self, envelope: EventEnvelope) -> None:
        pass

    def upstreams(self) -> Sequence[Upstream]:
        return [Upstream(stream="TRAINYARD_EVENTS", subject=JOBS, consumer="scheduler-events",
                         message_type=EventEnvelope, fold=self.count, react=self.answer)]

    def count(self, _: EventEnvelope) -> None:
        self.stops += 1
        if self.failing:
            raise RuntimeError("the fold failed")

    def answer(self, envelope: EventEnvelope) -> list[NewEvent]:
        return [NewEvent("node", f"n{self.stops}", NodeRecovered(node_name=f"n{self.stops}"))]


class Follower:
    """What the base reads of a follower."""

    def __init__(self) -> None:
        self.consumer, self.through = "scheduler-events", 0

    def positions(self) -> dict[str, int]:
        return {JOBS: self.through}


def runtime(log: EventLog) -> ServiceRuntime:
    found = fake_runtime(log, "launcher")
    found.store.epoch = None  # no lease taken
    return found


def delivered(sequence: int) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=sequence)), headers=None)


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[Taken]:
    found: list[Taken] = []

    async def save(_: Any, taken: Taken, data: bytes, versions: bytes, epoch: int | None) -> None:
        found.append(taken)

    monkeypatch.setattr(snapshots.StartSnapshots, "save", save)
    return found


async def test_a_snapshot_waits_for_a_failed_fold_to_be_handled_whole(saved: list[Taken]) -> None:
    log = EventLog()
    service = Counting(runtime(log))
    follower = Follower()
    service.followers.append(cast(StreamFollower, follower))
    upstream = service.upstreams()[0]
    stop = log.record("scheduler", "job", "job-000000000001", JobStopped(job_id="job-000000000001", by="bob"))

    await service.on_upstream(upstream, stop, delivered(1), Tracking("scheduler-events", 1))
    follower.through = 1
    assert await service.take_snapshot()
    assert saved[-1].upstream_after == {JOBS: 1} and saved[-1].state == b"1" and saved[-1].own_after == 2
    assert saved[-1].events == 1 and saved[-1].versions == snapshots.encode_versions({("node", "n1"): 1})

    service.failing = True  # folded, its reaction not recorded: it is tried again later
    with pytest.raises(RuntimeError):
        await service.on_upstream(upstream, stop, delivered(2), Tracking("scheduler-events", 2))
    assert not await service.take_snapshot()
    service.failing = False
    await service.on_upstream(upstream, stop, delivered(2), Tracking("scheduler-events", 2))
    follower.through = 2
    assert await service.take_snapshot()
    assert saved[-1].upstream_after == {JOBS: 2} and saved[-1].own_after == 3


async def test_a_snapshot_waits_for_a_reaction_that_calls_out_and_for_an_append_under_way(saved: list[Taken],
                                                                                        ) -> None:
    log = EventLog()
    service = Counting(runtime(log))
    follower = Follower()
    service.followers.append(cast(StreamFollower, follower))
    calling, answered = asyncio.Event(), asyncio.Event()

    async def precheck(message: Any, msg: Any, tracking: Tracking | None) -> bool:
        async with service.lock:
            service.stops += 1
        calling.set()
        await answered.wait()  # the agents are asked, outside the lock
        async with service.lock:
            await service.record(service.answer(message), tracking)
        return True

    handle = service._calling_out(service.upstreams()[0], precheck)
    stop = log.record("scheduler", "job", "job-000000000001", JobStopped(job_id="job-000000000001", by="bob"))
    handled = asyncio.ensure_future(handle(stop, delivered(5), Tracking("scheduler-events", 5)))
    await calling.wait()
    assert not await service.take_snapshot()
    answered.set()
    await handled
    follower.through = 5
    assert await service.take_snapshot()
    assert saved[-1].upstream_after == {JOBS: 5}

    service._appending = 1  # an append made outside the lock, its events not folded yet
    assert not await service.take_snapshot()
    service._appending = 0
    assert await service.take_snapshot()


def test_a_service_without_snapshot_code_takes_none() -> None:
    runtime = cast(ServiceRuntime, SimpleNamespace())
    assert EventSourcedService.snapshot_code == ()
    assert Counting(runtime).snapshot_format() == snapshots.code_format(("libs/skeleton/snapshots.py",))
