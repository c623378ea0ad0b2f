"""`trainyard at TIME …`: the scheduler's views at a past instant, rebuilt from its log and the events it follows
(real NATS and PostgreSQL; the monitor's node and the launcher's outcome published as those services do)."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.contracts import subjects
from libs.contracts.cluster import ClusterConfig, NodeInfo
from libs.contracts.codec import encode
from libs.contracts.events import Event, EventEnvelope, LaunchSucceeded, NodeRegistered
from libs.contracts.operations.planning import SimulationProgress
from libs.contracts.scheduling import Prediction
from services.scheduler.domain.names import upstream_consumer
from services.scheduler.history import past, start_snapshots
from services.scheduler.history.past_snapshots import PastSnapshots
from services.scheduler.service import Scheduler
from tests.support.replay import start_differences
from tests.support.schedulers import CLUSTER as CLUSTER_FILE
from tests.support.schedulers import Schedulers, refused, spec, token
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
CLUSTER = ClusterConfig.load(CLUSTER_FILE)


async def publish(nc: Client, service: str, aggregate_type: str, aggregate_id: str, event: Event) -> None:
    """An upstream event, as that service's outbox relay publishes it."""
    envelope = EventEnvelope(event_id=str(uuid.uuid4()), service=service, aggregate_type=aggregate_type,
                             aggregate_id=aggregate_id, version=1, position=1, recorded_at=datetime.now(UTC),
                             event=event)
    subject = subjects.event_subject(service, aggregate_type, type(event).__name__)
    await nc.jetstream().publish(subject, encode(envelope))


async def _status(client: TrainyardClient, job_id: str, status: str) -> bool:
    return (await client.get_job(job_id)).job.status == status


class FromTheFirstEvent(past.PastStates):
    """Past states made without snapshots."""

    async def _made_afresh(self, when: datetime) -> past._Replay:
        return past._Replay(self.store, self.js, self.cluster(), PastSnapshots(self.store.pool))


def told(expected: Prediction | None) -> tuple[object, ...]:
    """What a prediction tells, whenever it was made."""
    assert expected is not None
    return expected.estimated_start, expected.latest_start, expected.nodes, expected.position, expected.reason


async def instant() -> datetime:
    """A moment strictly between what came before and what comes after (the log's clock is to the microsecond)."""
    await asyncio.sleep(0.05)
    now = datetime.now(UTC)
    await asyncio.sleep(0.05)
    return now


@pytest.mark.parametrize("snapshot_every", [None, 2], ids=["from-the-first-event", "from-snapshots"])
async def test_views_at_past_instants_tell_what_the_scheduler_told_then(
        schedulers: Schedulers, nc: Client, nats_url: str, snapshot_every: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if snapshot_every is not None:  # past states saved every two events, and later ones started from them
        monkeypatch.setattr(past, "SNAPSHOT_EVENTS", snapshot_every)
    await schedulers.start()
    alice = await TrainyardClient.open(nats_url, token=token("alice"))
    bob = await TrainyardClient.open(nats_url, token=token("bob"))
    try:
        before = await instant()
        node = NodeInfo(name="node-a", address="127.0.0.1", cpus=1, memory_mib=2048)
        await publish(nc, "monitor", "node", "node-a", NodeRegistered(node=node))
        first = (await alice.submit(spec("first", duration="1h"))).job_id
        await eventually(lambda: _status(alice, first, "running"))
        second = (await alice.submit(spec("second", duration="1h"))).job_id
        await eventually(lambda: _status(alice, second, "queued"))
        said_then = await alice.why(second)
        # One story everywhere: show, list and queue give the start why gives (likely and latest).
        expected = (await alice.get_job(second)).job.expected
        assert expected is not None and expected.latest_start is not None
        assert said_then.head and expected.latest_start == expected.estimated_start == said_then.reserved_start
        listed = {j.job_id: j.expected for j in await alice.list_jobs()}
        assert told(listed[second]) == told(expected) and listed[first] is None
        assert [told(j.expected) for j in await alice.queue()] == [told(expected)]
        queued_at = await instant()
        await asyncio.sleep(1.5)  # the first runs a while: a second node would have started the second sooner
        await publish(nc, "launcher", "launch", first, LaunchSucceeded(job_id=first, attempt=1))
        await eventually(lambda: _status(alice, second, "running"))
        running_at = await instant()

        # While the second waited: the first held the node, the second was first in line for it.
        alice.at = queued_at
        assert {j.job_id: j.status for j in await alice.list_jobs()} == {first: "running", second: "queued"}
        assert [(j.job_id, j.queue_position) for j in await alice.queue()] == [(second, 1)]
        assert [(n.info.name, n.jobs) for n in await alice.nodes()] == [("node-a", [first])]
        said = await alice.why(second)
        assert said == said_then  # the exact answer the scheduler gave then
        assert told((await alice.get_job(second)).job.expected) == told(expected)
        assert said.head and said.reserved_nodes == ["node-a"]
        assert (await alice.get_job(second)).job.status == "queued"

        # Once the first succeeded: the second ran, nothing waited.
        alice.at = running_at
        assert {j.job_id: j.status for j in await alice.list_jobs()} == {first: "succeeded", second: "running"}
        assert await alice.queue() == []
        assert [(n.info.name, n.jobs) for n in await alice.nodes()] == [("node-a", [second])]
        assert (await alice.why(second)).summary[0].startswith("It is running")

        # Back to an earlier instant (a replay afresh), and before anything happened.
        alice.at = queued_at
        assert [j.job_id for j in await alice.queue()] == [second]
        alice.at = before
        assert await alice.list_jobs() == [] and await alice.nodes() == []
        assert (await refused(alice.get_job(first))).error.code == "not-found"

        runtime = schedulers.started[-1].rt
        made = await PastSnapshots(runtime.store.pool).latest(datetime.now(UTC))
        assert (made is None) == (snapshot_every is None)
        # From a snapshot or from the first event, an instant's state is the same, each event folded once.
        for when in (queued_at, running_at):
            monkeypatch.setattr(past, "SNAPSHOT_EVENTS", 10**9)
            async with past.PastStates(runtime.store, runtime.js, lambda: CLUSTER).at(when) as then:
                restored = (then.events, then.state.jobs, then.state.nodes, then.state.queue())
            async with FromTheFirstEvent(runtime.store, runtime.js, lambda: CLUSTER).at(when) as then:
                assert restored == (then.events, then.state.jobs, then.state.nodes, then.state.queue())

        # J2 holds in the past as now: bob sees none of alice's jobs.
        bob.at = queued_at
        assert await bob.list_jobs() == [] and await bob.queue() == []
        assert (await refused(bob.why(second))).error.code == "not-found"

        # The future is refused, with what to do instead.
        alice.at = datetime.now(UTC) + timedelta(hours=1)
        error = (await refused(alice.list_jobs())).error
        assert error.code == "invalid-request" and "future" in error.message

        # What if: replayed with no change, each starts the instant the record lets it; the differences from the
        # real starts are exactly the live scheduler's reaction times, however long this machine made them.
        assert (await refused(alice.simulate(before))).error.code == "forbidden"
        alice.at = None
        differences = start_differences(*[(await alice.get_job(job_id)).job for job_id in (first, second)])
        admin = await TrainyardClient.open(nats_url, token=token("root", admin=True))
        try:
            told_progress: list[SimulationProgress] = []
            report = await admin.simulate(before, running_at, on_progress=told_progress.append)
            assert told_progress and told_progress[0].stage == "rebuilding" and told_progress[0].events > 0
            assert (report.jobs, report.nodes_real, report.compared) == (2, 1, 2)
            assert report.start_difference_p95 == pytest.approx(max(differences), abs=1e-6), (report, differences)
            assert report.start_difference_p50 == pytest.approx(statistics.median(differences), abs=1e-6)
            assert [(w.priority, w.jobs) for w in report.waits] == [("normal", 2)]
            # With a second node, the second job would not have waited for the first. The first starts on its
            # submission as before: it is among the moved only when the live scheduler took a second to start it.
            more = await admin.simulate(before, running_at, add_nodes={"cpu-1": 1})
            assert more.nodes_simulated == 2
            assert {m.job_id for m in more.moved} == {second} | ({first} if differences[0] >= 1 else set())
            moved = next(m for m in more.moved if m.job_id == second)
            assert moved.simulated_start is not None and moved.real_start is not None
            assert moved.simulated_start == moved.submitted_at  # the second node free the instant it came
            assert moved.real_start - moved.submitted_at > timedelta(seconds=1.5)
            assert (await refused(admin.simulate(before, add_nodes={"gpu-64": 1}))).error.code == "invalid-request"
        finally:
            await admin.close()
    finally:
        await alice.close()
        await bob.close()


async def test_the_live_scheduler_keeps_snapshots_ahead_of_any_view(
        schedulers: Schedulers, nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(past, "SNAPSHOT_EVENTS", 10**9)  # none due until the jobs below are all recorded
    monkeypatch.setattr(past, "KEEP_AHEAD_SECONDS", 0.1)
    await schedulers.start()
    scheduler = schedulers.started[-1]
    assert scheduler.past is not None
    snapshots = PastSnapshots(scheduler.rt.store.pool)
    alice = await TrainyardClient.open(nats_url, token=token("alice"))
    try:
        await asyncio.sleep(0.3)
        assert await snapshots.latest(datetime.now(UTC)) is None  # nothing recorded, nothing due
        jobs = [(await alice.submit(spec(f"job-{n}"))).job_id for n in range(3)]

        # Every job's prediction recorded (a moment after its submission): the log grows no more.
        async def predicted() -> bool:
            return all([(await alice.get_job(job_id)).job.prediction is not None for job_id in jobs])

        await eventually(predicted)
        recorded = len([envelope async for envelope in scheduler.rt.store.read_all()])
        monkeypatch.setattr(past, "SNAPSHOT_EVENTS", 3)  # one due every three events of its own: due now

        # Made by the scheduler itself, before anyone asked for a past instant, up to the last event recorded; the
        # state it made is let go.
        async def made() -> bool:
            latest = await snapshots.latest(datetime.now(UTC))
            return latest is not None and latest.events == recorded

        await eventually(made)
        snapshot = await snapshots.latest(datetime.now(UTC))
        assert snapshot is not None and snapshot.events == recorded >= 6
        assert scheduler.past._kept is None
        # Not due again until the log has grown by as many events since.
        monkeypatch.setattr(past, "KEEP_AHEAD_SECONDS", 3600.0)
        await asyncio.sleep(0.2)
        assert not await scheduler.past.snapshot_if_due(datetime.now(UTC))

        # A view of that instant starts from the snapshot and has nothing more to fold.
        alice.at = snapshot.at
        assert {j.job_id for j in await alice.list_jobs()} <= set(jobs)
        async with scheduler.past.at(snapshot.at) as then:
            assert then.events == snapshot.events
    finally:
        await alice.close()


async def test_a_scheduler_starts_from_a_snapshot_and_its_followers_go_on_after_it(
        schedulers: Schedulers, nc: Client, nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(past, "SNAPSHOT_EVENTS", 3)
    monkeypatch.setattr(past, "KEEP_AHEAD_SECONDS", 3600.0)  # made when this test says
    await schedulers.start()
    live = schedulers.started[-1]
    assert live.past is not None
    store = live.rt.store
    alice = await TrainyardClient.open(nats_url, token=token("alice"))
    try:
        node = NodeInfo(name="node-a", address="127.0.0.1", cpus=1, memory_mib=2048)
        await publish(nc, "monitor", "node", "node-a", NodeRegistered(node=node))
        first = (await alice.submit(spec("first", duration="1h"))).job_id
        await eventually(lambda: _status(alice, first, "running"))
        second = (await alice.submit(spec("second", duration="1h"))).job_id

        async def handled() -> bool:  # the node's registration, which needed no answer, is noted as handled
            return (await store.tracked(upstream_consumer("monitor")))[0] > 0

        await eventually(handled)
        assert await live.past.snapshot_if_due(datetime.now(UTC))
        snapshot, = await PastSnapshots(store.pool).recent(1)
        node_subject, = subjects.events_of("monitor", "node")
        assert snapshot.own_after > 0 and snapshot.upstream_after[node_subject] > 0
        third = (await alice.submit(spec("third", priority="urgent"))).job_id  # after the snapshot
        await alice.stop([second])

        # A start restores it: its own log folded after it, its followers begin after what it holds of each stream.
        from_snapshot = Scheduler(live.rt, CLUSTER)
        held = await from_snapshot.rebuild()
        assert held > snapshot.events
        from_the_first = Scheduler(live.rt, CLUSTER)
        with monkeypatch.context() as without_snapshots:
            without_snapshots.setattr(start_snapshots, "restored", _none)
            await from_the_first.rebuild()
        for scheduler in (from_snapshot, from_the_first):  # folded only: the live scheduler answers
            for upstream in scheduler.upstreams():
                follower = scheduler.follower(dataclasses.replace(upstream, reactions=False))
                await follower.start()
                await follower.caught_up.wait()
                await follower.stop()
        assert from_snapshot.state.nodes == from_the_first.state.nodes and "node-a" in from_snapshot.state.nodes
        assert from_snapshot.state.jobs == from_the_first.state.jobs
        assert [j.job_id for j in from_snapshot.state.queue()] == [j.job_id for j in from_the_first.state.queue()]
        assert from_snapshot.state.used() == from_the_first.state.used()
        assert from_snapshot.versions == from_the_first.versions
        assert from_snapshot.state.jobs[second].status == "stopped" and third in from_snapshot.state.jobs

        # Passed over: a snapshot holding an upstream message the scheduler has not answered yet (a follower
        # beginning after it would never answer it), or made with another cluster config.
        consumer = upstream_consumer("monitor")
        position = (await store.tracked(consumer))[0]
        await store.pool.execute("UPDATE scheduler.tracking SET position = $2 WHERE consumer = $1", consumer,
                                 snapshot.upstream_after[node_subject] - 1)
        assert await start_snapshots.restored(store, live.rt.js, CLUSTER) is None
        await store.pool.execute("UPDATE scheduler.tracking SET position = $2 WHERE consumer = $1", consumer, position)
        assert await start_snapshots.restored(store, live.rt.js, CLUSTER) is not None
        assert await start_snapshots.restored(store, live.rt.js, ClusterConfig(flavors=CLUSTER.flavors[:1])) is None

        # A scheduler started from it goes on where the last left off: it knows the node it was told of before the
        # snapshot (its follower does not read that again), answers what comes after, records at the right
        # versions and decides.
        await schedulers.stop_all()
        await schedulers.start()
        assert schedulers.started[-1].followers[0].folded  # started after what the snapshot holds
        fourth = (await alice.submit(spec("fourth", duration="1h"))).job_id
        await publish(nc, "launcher", "launch", first, LaunchSucceeded(job_id=first, attempt=1))
        await eventually(lambda: _status(alice, third, "running"))  # urgent: before the fourth
        assert (await alice.get_job(first)).job.status == "succeeded"
        assert (await alice.get_job(fourth)).job.status == "queued"
        assert [j.job_id for j in await alice.queue()] == [fourth]
    finally:
        await alice.close()


async def _none(*_: object) -> None:
    return None
