"""The monitor on real NATS, PostgreSQL and SMTP: health marks and alerts (M2, M7), pre-checks (M1),
slow iterations (M6) and debug environments (J15).

The scheduler's side is played by appending to a "scheduler" event store and publishing it with
its outbox relay, exactly as the scheduler's own relay would; node agents are plain NATS
subscriptions answering the monitor's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from libs.auth import bearer_headers, issue_node_token, issue_token
from libs.contracts import subjects
from libs.contracts.agent import (
    Heartbeat,
    LogChunk,
    NodeAccepted,
    OpenSession,
    PrecheckNode,
    PrecheckReport,
    RegisterNode,
    Released,
    ReleaseWorkspaces,
    SessionOpened,
)
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import decode, decode_any, encode
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    ComponentMarked,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    Event,
    EventEnvelope,
    JobAdmitted,
    JobFailed,
    JobPrechecking,
    JobSubmitted,
    JobSucceeded,
    NodeHealthy,
    NodeLost,
    NodeRecovered,
    NodeUnhealthy,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
    UpstreamMessageSetAside,
    set_aside_id,
)
from libs.contracts.health import ComponentHealth
from libs.contracts.identity import Identity
from libs.contracts.jobspec import (
    AlgorithmRef,
    CheckpointResume,
    DebugTerminal,
    JobSpec,
    OutputRef,
    PerformanceDetection,
)
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cluster import MARK_COMPONENT, MarkComponent
from libs.contracts.operations.runs import OPEN_TERMINAL, OpenTerminal, TerminalOpened
from libs.controlsign import ControlVerifier
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.connection import round_trip
from libs.messaging.reader import read_subject
from libs.messaging.rpc import call
from libs.natsroles import MONITOR_LOGS_CONSUMER as LOGS_CONSUMER
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.monitor.service import Monitor
from tests.support.mailbox import Mailbox
from tests.support.monitor import start_monitor
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"
SECRET = "integration-tests-signing-secret-0123456789abcdef"
OPERATOR = "ops@example.com"
CREATOR = "alice@example.com"
HEALTHY = [ComponentHealth(kind="nic", name="eth0", healthy=True),
           ComponentHealth(kind="board", name="0", healthy=True)]


def token(user: str, *projects: str, admin: bool = False) -> str:
    return issue_token(SECRET, Identity(user=user, projects=list(projects or ["default"]), admin=admin))


class Platform:
    """The monitor (restartable, in this process), the scheduler's log, and fake node agents."""

    def __init__(self, nats_url: str, database_url: str, smtp_url: str, nc: Client, scheduler: EventStore,
                 monitor_log: EventStore) -> None:
        self.settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET,
                                 smtp_url=smtp_url, alert_emails=(OPERATOR,), node_lost_seconds=3600)
        self.nc = nc
        self.scheduler = scheduler
        self.relay = OutboxRelay(scheduler, nc.jetstream())
        self.monitor_log = monitor_log
        self.versions: dict[str, int] = {}
        self.runtime: ServiceRuntime | None = None
        self.monitor: Monitor | None = None
        self.agent_requests: list[Any] = []

    async def start(self, **settings: Any) -> Monitor:
        runtime, monitor = await start_monitor(dataclasses.replace(self.settings, **settings))
        self.runtime, self.monitor = runtime, monitor
        return monitor

    async def stop(self) -> None:
        if self.runtime is not None:
            await self.runtime.close()
            self.runtime = None

    async def restart(self) -> Monitor:
        # Stop with the relay idle: the shared relay's wait can miss a cancel that comes with a wake-up.
        await eventually(self._relayed)
        await self.stop()
        return await self.start()

    async def _relayed(self) -> bool:
        published = await self.monitor_log.pool.fetchval("SELECT published_position FROM monitor.relay")
        return bool(published == await self.monitor_log.last_position())

    async def scheduler_records(self, job_id: str, *events: Event) -> None:
        """Append to the scheduler's log and publish, as the scheduler does."""
        version = self.versions.get(job_id, 0)
        await self.scheduler.append([NewEvent("job", job_id, e) for e in events],
                                    expected_versions={("job", job_id): version})
        self.versions[job_id] = version + len(events)
        while await self.relay.publish_pending():
            pass

    async def register(self, name: str) -> None:
        info = NodeInfo(name=name, address="127.0.0.1", cpus=8, memory_mib=16384)
        reply = await call(self.nc, REGISTER_NODE.subject, RegisterNode(node=info),
                           reply_type=NodeAccepted | CommandError, token=issue_node_token(SECRET, name))
        assert isinstance(reply, NodeAccepted)

    async def heartbeat(self, name: str, health: list[ComponentHealth]) -> None:
        await self.nc.publish(subjects.heartbeat(name), encode(Heartbeat(node=name, sent_at=datetime.now(UTC),
                                                                          health=health)),
                              headers=bearer_headers(issue_node_token(SECRET, name)))

    async def fake_agent(self, name: str) -> None:
        """Answers pre-checks (all healthy), releases and session openings for node `name`, when the
        monitor signed them, as a real agent does."""
        control = ControlVerifier.of_secret(SECRET)

        async def answer(msg: Msg) -> None:
            request = decode_any(msg.data, PrecheckNode | ReleaseWorkspaces | OpenSession)
            if (reason := control.refusal("monitor", msg.subject, msg.data, msg.headers, time.time())) is not None:
                await msg.respond(encode(CommandError(code="unauthenticated", message=reason)))
                return
            self.agent_requests.append((name, request))
            if isinstance(request, PrecheckNode):
                reply: msgspec.Struct = PrecheckReport(node=name, checks=HEALTHY)
            elif isinstance(request, ReleaseWorkspaces):
                reply = Released(removed=1)
            else:
                reply = SessionOpened(session_id=request.session_id, pid=4242)
            await msg.respond(encode(reply))

        for subject in (subjects.agent_precheck(name), subjects.agent_release(name), subjects.agent_open_session(name)):
            await self.nc.subscribe(subject, cb=answer)
        await round_trip(self.nc)

    def requests(self, kind: type[T]) -> list[tuple[str, T]]:
        return [(node, r) for node, r in self.agent_requests if isinstance(r, kind)]

    async def recorded(self, kind: type[T]) -> list[T]:
        """The monitor's events of one kind, from its log."""
        return [e.event async for e in self.monitor_log.read_all() if isinstance(e.event, kind)]



@pytest_asyncio.fixture(loop_scope="session")
async def mailbox() -> AsyncIterator[Mailbox]:
    box = Mailbox()
    box.controller.start()
    yield box
    box.controller.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def platform(nats_url: str, database_url: str, nc: Client, make_store: StoreFactory,
                   mailbox: Mailbox) -> AsyncIterator[Platform]:
    stack = Platform(nats_url, database_url, mailbox.url, nc, await make_store("scheduler"),
                     await make_store("monitor"))
    yield stack
    await stack.stop()


def spec(name: str, **changes: Any) -> JobSpec:
    base = JobSpec(name=name, flavors=["cpu-2"], pool="resilient", algorithm=AlgorithmRef(name="algo"),
                   command="python3 train.py", output=OutputRef(name="out"))
    return msgspec.structs.replace(base, **changes)


def submitted(job_id: str, job_spec: JobSpec, creator: str = "alice") -> JobSubmitted:
    return JobSubmitted(job_id=job_id, spec=job_spec, creator=creator, creator_email=CREATOR)


def placed(*nodes: str) -> list[Placement]:
    return [Placement(rank=i, node=n, address="127.0.0.1", slots=1) for i, n in enumerate(nodes)]


async def mark(nc: Client, node: str, component: str, *, user: str = "root", admin: bool = True,
               faulty: bool = True, reason: str = "drill") -> Done | CommandError:
    request = MarkComponent(node=node, component=component, faulty=faulty, reason=reason)
    reply: Done | CommandError = await call(nc, MARK_COMPONENT.subject, request, token=token(user, admin=admin),
                                            reply_type=Done | CommandError)
    return reply


async def test_a_marked_board_makes_its_node_unhealthy_with_one_alert_by_mail_and_on_nats(
        platform: Platform, mailbox: Mailbox, nc: Client) -> None:
    await platform.start()
    await platform.register("node-a")

    assert isinstance(await mark(nc, "node-a", "board:0"), Done)
    [unhealthy] = await eventually(lambda: platform.recorded(NodeUnhealthy))
    assert unhealthy.problems == ["board:0 faulty (marked by root: drill)"]
    again = await mark(nc, "node-a", "board:0")
    assert isinstance(again, Done) and "already" in again.message
    assert len(await platform.recorded(ComponentMarked)) == 1

    # Alerting consumers see the alert on NATS, and the operators get one mail.
    async def published() -> list[AlertRaised]:
        found = [decode(m.data, EventEnvelope).event async for m in
                 read_subject(nc.jetstream(), subjects.EVENTS_STREAM, subjects.ALERTS_ALL)]
        return [e for e in found if isinstance(e, AlertRaised)]
    [alert] = await eventually(published)
    assert (alert.kind, alert.node, alert.recipients) == ("node-unhealthy", "node-a", [OPERATOR])
    # People read it through the monitor (ListAlerts), never from the stream; only with a token. Whom it
    # was mailed to, only administrators read.
    listed = await call(nc, LIST_ALERTS.subject, ListAlerts(), token=token("someone"),
                        reply_type=AlertPage | CommandError)
    assert isinstance(listed, AlertPage)
    assert [e.event for e in listed.alerts] == [msgspec.structs.replace(alert, recipients=[])]
    refused = await call(nc, LIST_ALERTS.subject, ListAlerts(), reply_type=AlertPage | CommandError)
    assert isinstance(refused, CommandError) and refused.code == "unauthenticated"
    await eventually(lambda: platform.recorded(AlertMailed))
    assert len(mailbox.messages) == 1
    assert mailbox.messages[0].rcpt_tos == [OPERATOR]
    assert b"Node node-a is unhealthy" in (mailbox.messages[0].original_content or b"")

    # A probed fault while unhealthy changes the problems but is not a new alert.
    await platform.heartbeat("node-a", [ComponentHealth(kind="nic", name="eth0", healthy=False, detail="link down")])
    await eventually(lambda: _count(platform.recorded(NodeUnhealthy), 2))
    problems = (await platform.recorded(NodeUnhealthy))[-1].problems
    assert problems == ["board:0 faulty (marked by root: drill)", "nic:eth0 faulty (link down)"]

    # Healthy again once the probe is clean and the mark cleared.
    await platform.heartbeat("node-a", HEALTHY)
    assert isinstance(await mark(nc, "node-a", "board:0", faulty=False), Done)
    await eventually(lambda: platform.recorded(NodeHealthy))
    assert len(await platform.recorded(AlertRaised)) == 1

    # A restart finds the alert mailed: nothing is sent again.
    monitor = await platform.restart()
    assert monitor.state.unmailed == {}
    assert len(mailbox.messages) == 1


async def _count(found: Awaitable[list[Any]], count: int) -> bool:
    return len(await found) >= count


async def test_a_silent_node_is_lost_with_an_alert_and_recovers_on_its_next_heartbeat(
        platform: Platform, mailbox: Mailbox) -> None:
    await platform.start(node_lost_seconds=1.0)
    await platform.register("node-a")
    [lost] = await eventually(lambda: platform.recorded(NodeLost))
    assert lost.node_name == "node-a"
    [alert] = await platform.recorded(AlertRaised)
    assert (alert.alert_id, alert.kind) == ("node-lost-node-a-2", "node-lost")
    await eventually(lambda: platform.recorded(AlertMailed))
    assert [m.rcpt_tos for m in mailbox.messages] == [[OPERATOR]]
    await platform.heartbeat("node-a", HEALTHY)
    await eventually(lambda: platform.recorded(NodeRecovered))


async def test_in_a_batch_of_heartbeats_each_node_counts_by_its_latest_and_a_forged_one_not_at_all(
        platform: Platform, nc: Client) -> None:
    monitor = await platform.start()
    await platform.register("node-a")
    await platform.register("node-b")
    faulty = [ComponentHealth(kind="nic", name="eth0", healthy=False, detail="link down")]

    def beat(name: str, health: list[ComponentHealth], credential_of: str) -> Msg:
        body = encode(Heartbeat(node=name, sent_at=datetime.now(UTC), health=health))
        return Msg(nc, subject=subjects.heartbeat(name), data=body,
                   headers=bearer_headers(issue_node_token(SECRET, credential_of)))

    seen_b = monitor.state.nodes["node-b"].last_seen
    # node-a's fault is over by the batch's end; node-b's heartbeat carries node-a's credential.
    await monitor.on_heartbeats([beat("node-a", faulty, "node-a"), beat("node-b", faulty, "node-a"),
                                 beat("node-a", HEALTHY, "node-a")])
    assert await platform.recorded(NodeUnhealthy) == []
    assert monitor.state.nodes["node-a"].probed == HEALTHY
    assert monitor.state.nodes["node-b"].last_seen == seen_b
    # Alone in its batch, the fault is recorded.
    await monitor.on_heartbeats([beat("node-a", faulty, "node-a")])
    [unhealthy] = await platform.recorded(NodeUnhealthy)
    assert unhealthy.problems == ["nic:eth0 faulty (link down)"]


async def test_only_administrators_mark_components_of_known_nodes(platform: Platform, nc: Client) -> None:
    await platform.start()
    await platform.register("node-a")
    refused = await mark(nc, "node-a", "board:0", user="alice", admin=False)
    assert isinstance(refused, CommandError) and refused.code == "forbidden"
    unknown = await mark(nc, "node-z", "board:0")
    assert isinstance(unknown, CommandError) and unknown.code == "not-found"
    malformed = await mark(nc, "node-a", "gpu 0")
    assert isinstance(malformed, CommandError) and malformed.code == "invalid-request"
    assert "board:0" in (malformed.hint or "")
    anonymous = await call(nc, MARK_COMPONENT.subject, MarkComponent(node="node-a", component="board:0"),
                           reply_type=Done | CommandError)
    assert isinstance(anonymous, CommandError) and anonymous.code == "unauthenticated"
    assert await platform.recorded(ComponentMarked) == []


async def test_a_prechecking_job_is_checked_once_on_its_nodes(platform: Platform, mailbox: Mailbox,
                                                              nc: Client) -> None:
    await platform.start()
    for node in ("node-a", "node-b"):
        await platform.register(node)
    await platform.fake_agent("node-a")
    await mark(nc, "node-b", "board:0")
    job = "job-00000000000a"
    job_spec = spec("resumable", checkpoint_resume=CheckpointResume(max_resumes=2))
    await platform.scheduler_records(job, submitted(job, job_spec),
                                     JobPrechecking(job_id=job, attempt=1, flavor="cpu-2", placement=placed("node-a")))

    [passed] = await eventually(lambda: platform.recorded(PrecheckCompleted))
    assert passed.passed and [c.node for c in passed.nodes] == ["node-a"]
    [(_, asked)] = platform.requests(PrecheckNode)
    assert (asked.job_id, asked.cpus, asked.memory_mib) == (job, 2, 2048)

    # The next attempt is placed on node-b too, whose board is marked: it fails there, without asking it.
    await platform.scheduler_records(job, JobPrechecking(job_id=job, attempt=2, flavor="cpu-2",
                                                         placement=placed("node-a", "node-b")))
    await eventually(lambda: _count(platform.recorded(PrecheckCompleted), 2))
    failed = (await platform.recorded(PrecheckCompleted))[-1]
    assert (failed.attempt, failed.passed) == (2, False)
    verdicts = {c.node: c for c in failed.nodes}
    assert verdicts["node-a"].passed
    assert verdicts["node-b"].problems() == ["board:0 faulty (marked by root: drill)"]
    assert [node for node, _ in platform.requests(PrecheckNode)] == ["node-a", "node-a"]
    alerts = [a for a in await platform.recorded(AlertRaised) if a.kind == "precheck-failed"]
    assert [(a.alert_id, a.recipients) for a in alerts] == [(f"precheck-failed-{job}-2", [CREATOR, OPERATOR])]

    # Replaying the scheduler's events after a restart checks nothing again.
    await platform.restart()
    assert len(await platform.recorded(PrecheckCompleted)) == 2
    assert len(platform.requests(PrecheckNode)) == 2


async def test_slow_iterations_raise_one_incident_and_one_mail(platform: Platform, mailbox: Mailbox,
                                                               nc: Client) -> None:
    job, other = "job-00000000000b", "job-00000000000c"
    detection = PerformanceDetection(threshold=0.8, window=3)
    await platform.scheduler_records(job, submitted(job, spec("slow", checkpoint_resume=CheckpointResume(
        performance=detection))), JobAdmitted(job_id=job, attempt=1, flavor="cpu-2", placement=placed("node-a")))
    await platform.scheduler_records(other, submitted(other, spec("unwatched")),
                                     JobAdmitted(job_id=other, attempt=1, flavor="cpu-2", placement=placed("node-b")))
    await platform.start()
    js = nc.jetstream()
    await eventually(lambda: _consumer_exists(nc))
    seqs = {"n": 0}

    async def log_lines(job_id: str, attempt: int, ratios: list[float]) -> None:
        lines = ["loading data", *(f"this iteration hardware time is {r * 2000:.3f} and e2e time is 2000 ms."
                                   for r in ratios)]
        seqs["n"] += 1
        chunk = LogChunk(job_id=job_id, attempt=attempt, rank=0, node="node-a", seq=seqs["n"], lines=lines)
        await js.publish(subjects.node_logs(job_id, 0, chunk.node), encode(chunk))

    await log_lines(job, 1, [0.5, 0.5, 0.5])
    await log_lines(other, 1, [0.95] * 5)  # no performance detection asked for
    await log_lines(job, 0, [0.95] * 5)  # not the current attempt
    await log_lines(job, 1, [0.9] * 10)
    await log_lines(job, 1, [0.99] * 10)  # the same incident goes on
    await eventually(lambda: _all_read(nc))

    [incident] = await platform.recorded(PerformanceDegraded)
    assert (incident.job_id, incident.attempt, incident.rank, incident.node, incident.action) == (
        job, 1, 0, "node-a", "alert")
    assert incident.ratio > 0.8
    await eventually(lambda: platform.recorded(AlertMailed))
    assert len(mailbox.messages) == 1
    assert sorted(mailbox.messages[0].rcpt_tos) == sorted([CREATOR, OPERATOR])

    # After a restart the incident still going on is not recorded again.
    await platform.restart()
    await log_lines(job, 1, [0.95] * 10)
    await eventually(lambda: _all_read(nc))
    assert len(await platform.recorded(PerformanceDegraded)) == 1
    assert len(await platform.recorded(AlertRaised)) == 1


async def _consumer_exists(nc: Client) -> bool:
    try:
        await nc.jetstream().consumer_info(subjects.LOGS_STREAM, LOGS_CONSUMER)
    except NotFoundError:
        return False
    return True


async def _all_read(nc: Client) -> bool:
    """The monitor acknowledged every log chunk published so far."""
    js = nc.jetstream()
    stream = await js.stream_info(subjects.LOGS_STREAM)
    consumer = await js.consumer_info(subjects.LOGS_STREAM, LOGS_CONSUMER)
    return consumer.ack_floor is not None and consumer.ack_floor.stream_seq >= stream.state.last_seq


async def test_a_failed_jobs_environment_is_kept_then_released(platform: Platform) -> None:
    await platform.start()
    await platform.register("node-a")
    await platform.fake_agent("node-a")
    failed, succeeded = "job-00000000000d", "job-00000000000e"
    debug = spec("debug-me", debug_terminal=DebugTerminal(retention="1s"))
    await platform.scheduler_records(failed, submitted(failed, debug),
                                     JobAdmitted(job_id=failed, attempt=1, flavor="cpu-2", placement=placed("node-a")),
                                     JobFailed(job_id=failed, reason="rank 0 exited with code 4", exit_code=4))
    [kept] = await eventually(lambda: platform.recorded(DebugEnvironmentKept))
    assert (kept.job_id, kept.attempt, kept.nodes) == (failed, 1, ["node-a"])
    [released] = await eventually(lambda: platform.recorded(DebugEnvironmentReleased))
    assert (released.job_id, released.attempt) == (failed, 1)
    assert [(n, r.job_id) for n, r in platform.requests(ReleaseWorkspaces)] == [("node-a", failed)]

    # A job that ends well keeps nothing: its workspaces are released at once.
    await platform.scheduler_records(succeeded, submitted(succeeded, debug),
                                     JobAdmitted(job_id=succeeded, attempt=1, flavor="cpu-2",
                                                 placement=placed("node-a")),
                                     JobSucceeded(job_id=succeeded))
    await eventually(lambda: _released(platform, succeeded))
    assert [k.job_id for k in await platform.recorded(DebugEnvironmentKept)] == [failed]


async def _released(platform: Platform, job_id: str) -> bool:
    return any(r.job_id == job_id for _, r in platform.requests(ReleaseWorkspaces))


async def test_the_debug_terminal_opens_in_a_kept_environment_for_those_allowed(platform: Platform,
                                                                                nc: Client) -> None:
    await platform.start()
    await platform.register("node-a")
    await platform.fake_agent("node-a")
    job, queued = "job-00000000000f", "job-000000000010"
    debug = spec("debug-me", project="vision", access="read-only", debug_terminal=DebugTerminal(retention="1h"))
    await platform.scheduler_records(job, submitted(job, debug),
                                     JobAdmitted(job_id=job, attempt=1, flavor="cpu-2", placement=placed("node-a")),
                                     JobFailed(job_id=job, reason="rank 0 exited with code 4", exit_code=4))
    await platform.scheduler_records(queued, submitted(queued, debug))
    await eventually(lambda: platform.recorded(DebugEnvironmentKept))

    async def terminal(user: str, job_id: str, **extra: Any) -> TerminalOpened | CommandError:
        reply: TerminalOpened | CommandError = await call(
            nc, OPEN_TERMINAL.subject, OpenTerminal(job_id=job_id, **extra), token=token(user, "vision"),
            reply_type=TerminalOpened | CommandError)
        return reply

    opened = await terminal("alice", job, command="ls")
    assert isinstance(opened, TerminalOpened)
    assert (opened.node, opened.rank, opened.attempt) == ("node-a", 0, 1)
    [(node, session)] = platform.requests(OpenSession)
    assert (node, session.session_id, session.job_id, session.command) == ("node-a", opened.session_id, job, "ls")

    reader = await terminal("bob", job)  # read-only access to the job
    assert isinstance(reader, CommandError) and reader.code == "forbidden"
    stranger = await call(nc, OPEN_TERMINAL.subject, OpenTerminal(job_id=job), token=token("carol", "nlp"),
                          reply_type=TerminalOpened | CommandError)
    assert isinstance(stranger, CommandError) and stranger.code == "not-found"
    elsewhere = await terminal("alice", job, node="node-b")
    assert isinstance(elsewhere, CommandError) and elsewhere.code == "invalid-request"
    waiting = await terminal("alice", queued)
    assert isinstance(waiting, CommandError) and waiting.code == "invalid-state"
    assert "not started" in waiting.message


async def test_every_message_set_aside_becomes_one_alert_its_own_included(platform: Platform, mailbox: Mailbox,
                                                                          nc: Client) -> None:
    await platform.start()
    # The monitor itself sets aside garbage on a scheduler subject it follows ...
    await nc.jetstream().publish(subjects.event_subject("scheduler", "job", "JobSucceeded"),
                                 b"not an envelope")
    # ... and the scheduler recorded one it set aside.
    record = UpstreamMessageSetAside(consumer="monitor-events", stream=subjects.EVENTS_STREAM, sequence=7,
                                     subject="trainyard.events.monitor.job.job-00000000000f.JobSucceeded",
                                     cause="inconsistent", reason="claims service scheduler",
                                     claimed_service="scheduler", claimed_type="JobSucceeded.v1")
    await platform.scheduler.append([NewEvent("upstream", set_aside_id("monitor-events", 7), record)],
                                    expected_versions={("upstream", "monitor-events-7"): 0})
    while await platform.relay.publish_pending():
        pass

    alerts = await eventually(lambda: _at_least(platform.recorded(AlertRaised), 2))
    assert sorted(a.alert_id for a in alerts) == ["message-set-aside-monitor-scheduler-events-1",
                                                   "message-set-aside-scheduler-monitor-events-7"]
    assert {a.kind for a in alerts} == {"message-set-aside"}
    assert all(a.recipients == [OPERATOR] for a in alerts)
    forged = next(a for a in alerts if "monitor-events-7" in a.alert_id)
    assert "claimed service scheduler" in forged.message and "inconsistent" in forged.message
    [own] = await platform.recorded(UpstreamMessageSetAside)
    assert (own.consumer, own.cause) == ("scheduler-events", "undecodable")
    await eventually(lambda: _at_least(platform.recorded(AlertMailed), 2))

    # A restart replays both records and raises nothing again.
    await platform.restart()
    await asyncio.sleep(0.5)
    assert len(await platform.recorded(AlertRaised)) == 2
    assert len(await platform.recorded(UpstreamMessageSetAside)) == 1
    assert len(mailbox.messages) == 2


async def test_each_event_of_a_bundle_set_aside_becomes_an_alert_of_its_own(platform: Platform, nc: Client) -> None:
    """Two events of one bundle the monitor cannot read: two alerts, each naming its event, not one hiding the other,
    and each recorded once."""
    await platform.start()
    ack = await nc.jetstream().publish(subjects.bundle_subject("scheduler", "job"),
                                       b'[{"event_id": "a", "type": "JobTeleported.v1"}, "not an envelope"]')

    alerts = await eventually(lambda: _at_least(platform.recorded(AlertRaised), 2))
    assert sorted(a.alert_id for a in alerts) == [f"message-set-aside-monitor-scheduler-events-{ack.seq}.{part}"
                                                   for part in (0, 1)]
    assert all(f"event {part} (from 0) of the bundle at sequence {ack.seq}" in alert.message
               for part, alert in enumerate(sorted(alerts, key=lambda a: a.alert_id)))

    # The second has no position to be tracked by: a restart, which reads the bundle again, records it no more.
    await platform.restart()
    await asyncio.sleep(0.5)
    assert len(await platform.recorded(AlertRaised)) == 2
    assert [r.part for r in await platform.recorded(UpstreamMessageSetAside)] == [0, 1]


async def _at_least(found: Awaitable[list[T]], count: int) -> list[T]:
    items = await found
    return items if len(items) >= count else []


async def test_a_stopped_monitor_leaves_nothing_of_its_own_running(platform: Platform) -> None:
    before = asyncio.all_tasks()
    monitor = await platform.start()
    # A scheduler event the monitor only folds: its follower writes the position down a while later.
    await platform.scheduler_records("job-000000000011", submitted("job-000000000011", spec("quiet")))
    await eventually(lambda: _folded(monitor, "job-000000000011"))
    await platform.stop()

    # The monitor's tasks are named (its loops, and each follower's worker and position writer); a cancelled one
    # ends when the loop next runs it, one still running after that never does.
    async def none_left() -> bool:
        return not [t for t in asyncio.all_tasks() - before if not t.done() and not t.get_name().startswith("Task-")]

    with contextlib.suppress(TimeoutError):
        await eventually(none_left)
    left = [t.get_name() for t in asyncio.all_tasks() - before if not t.done() and not t.get_name().startswith("Task-")]
    assert left == []


async def _folded(monitor: Monitor, job_id: str) -> bool:
    return job_id in monitor.jobs.jobs
