"""An archived job on the real monitor, NATS and PostgreSQL: once the scheduler archives it the monitor holds
nothing of it, and still answers `trainyard metrics` (the run, its series), a watch of it, the alerts about it
and its debug terminal to those who may view it, from its history read back from TRAINYARD_EVENTS; to anyone
else it is a job that does not exist.

The scheduler's and the launcher's sides are played by appending to their event stores and publishing them with
their outbox relays, as theirs would; node-a's agent is a NATS subscription answering the monitor's releases.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.auth import issue_node_token, issue_token
from libs.contracts import subjects
from libs.contracts.agent import NodeAccepted, RegisterNode, Released
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.events import (
    AlertRaised,
    DebugEnvironmentReleased,
    Event,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobFailed,
    JobSubmitted,
    JobSucceeded,
    NodeProcessExited,
    NodeProcessStarted,
    Placement,
    RunFinished,
    RunLived,
)
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import CheckpointResume, DebugTerminal
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import (
    GET_RUN,
    GET_SERIES,
    OPEN_TERMINAL,
    GetRun,
    GetSeries,
    OpenTerminal,
    RunView,
    SeriesPage,
    TerminalOpened,
)
from libs.contracts.operations.watches import WATCH_JOB, Watching, WatchJob
from libs.contracts.runs import MetricBatch, MetricPoint
from libs.eventstore import EventStore, NewEvent, OutboxRelay
from libs.messaging.connection import round_trip
from libs.messaging.rpc import call
from libs.natsroles import inbox_prefix, user_nats_name
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.monitor.service import Monitor
from tests.support.monitor import start_monitor
from tests.support.specs import sleeper
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
SECRET = "integration-tests-signing-secret-0123456789abcdef"
AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
PLACED = [Placement(rank=0, node="node-a", address="127.0.0.1", slots=1)]
SPEC = msgspec.structs.replace(sleeper("logger"), project="vision", access="none")


def token(user: str, project: str) -> str:
    return issue_token(SECRET, Identity(user=user, projects=[project]))


ALICE, CAROL = token("alice", "vision"), token("carol", "nlp")  # its creator; someone of another project


class Platform:
    """The monitor (in this process), the scheduler's and the launcher's logs, and node-a's agent."""

    def __init__(self, nc: Client, scheduler: EventStore, launcher: EventStore, monitor_log: EventStore) -> None:
        self.nc = nc
        self.logs = {"job": scheduler, "launch": launcher}
        self.relays = {kind: OutboxRelay(store, nc.jetstream()) for kind, store in self.logs.items()}
        self.monitor_log = monitor_log
        self.versions: dict[tuple[str, str], int] = {}
        self.runtime: ServiceRuntime | None = None

    async def start(self, nats_url: str, database_url: str) -> Monitor:
        settings = Settings(nats_url=nats_url, database_url=database_url, auth_secret=SECRET, smtp_url=None,
                            alert_emails=("ops@example.com",), node_lost_seconds=3600)
        self.runtime, monitor = await start_monitor(settings)
        info = NodeInfo(name="node-a", address="127.0.0.1", cpus=8, memory_mib=16384)
        accepted = await call(self.nc, REGISTER_NODE.subject, RegisterNode(node=info),
                              reply_type=NodeAccepted | CommandError, token=issue_node_token(SECRET, "node-a"))
        assert isinstance(accepted, NodeAccepted)

        async def release(msg: Msg) -> None:
            await msg.respond(encode(Released(removed=1)))

        await self.nc.subscribe(subjects.agent_release("node-a"), cb=release)
        await round_trip(self.nc)
        return monitor

    async def records(self, aggregate_type: str, job_id: str, *events: Event) -> None:
        """Append to the scheduler's log ("job") or the launcher's ("launch") and publish, as they do."""
        key = (aggregate_type, job_id)
        version = self.versions.get(key, 0)
        await self.logs[aggregate_type].append([NewEvent(aggregate_type, job_id, e) for e in events],
                                               expected_versions={key: version})
        self.versions[key] = version + len(events)
        while await self.relays[aggregate_type].publish_pending():
            pass

    async def recorded(self, kind: type[T], job_id: str) -> list[T]:
        """The monitor's events of one kind about the job, from its log."""
        return [e.event async for e in self.monitor_log.read_all()
                if isinstance(e.event, kind) and getattr(e.event, "job_id", None) == job_id]

    async def finished(self, job_id: str) -> bool:
        """Whether the job's run is finished in the monitor's log (a start and end that came together: lived whole)."""
        return bool(await self.recorded(RunFinished, job_id) or await self.recorded(RunLived, job_id))


@pytest_asyncio.fixture(loop_scope="session")
async def platform(nc: Client, make_store: StoreFactory) -> AsyncIterator[Platform]:
    stack = Platform(nc, await make_store("scheduler"), await make_store("launcher"), await make_store("monitor"))
    yield stack
    if stack.runtime is not None:
        await stack.runtime.close()


async def ask(nc: Client, operation: Any, request: msgspec.Struct, as_who: str, reply: Any) -> Any:
    return await call(nc, operation.subject, request, token=as_who, reply_type=reply | CommandError)


async def archive(platform: Platform, monitor: Monitor, job_id: str) -> None:
    """The scheduler archives the job; the monitor lets go of it."""
    await platform.records("job", job_id, JobArchived(job_id=job_id, retention="1m"))

    async def let_go() -> bool:
        return job_id not in monitor.jobs.jobs and job_id not in monitor.state.runs
    await eventually(let_go)


async def test_metrics_answer_for_an_archived_job_to_its_creator_and_not_to_who_may_not_view_it(
        platform: Platform, nc: Client, nats_url: str, database_url: str) -> None:
    monitor = await platform.start(nats_url, database_url)
    job_id, made_up = new_job_id(), new_job_id()
    await platform.records("job", job_id, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"),
                           JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED))
    await platform.records("launch", job_id, NodeProcessStarted(job_id=job_id, attempt=1, rank=0, node="node-a",
                                                                pid=7, started_at=AT))
    batch = MetricBatch(job_id=job_id, attempt=1, task=0, rank=0, node="node-a", process="pid-7",
                        points=[MetricPoint(seq=seq, name="loss", value=1.0 / seq, at=AT, step=seq)
                                for seq in range(1, 101)], summary={"final_loss": 0.01})
    await nc.jetstream().publish(subjects.job_metrics(job_id, "node-a"), encode(batch),
                                 headers={"Nats-Msg-Id": f"{job_id}.0.1"})
    await platform.records("launch", job_id, NodeProcessExited(job_id=job_id, attempt=1, rank=0, node="node-a",
                                                               exit_code=0, exited_at=AT))
    await platform.records("job", job_id, JobSucceeded(job_id=job_id))
    await eventually(lambda: platform.finished(job_id))
    before: RunView = await ask(nc, GET_RUN, GetRun(job_id=job_id), ALICE, RunView)
    assert isinstance(before, RunView) and before.state == "finished" and before.series[0].count == 100

    await archive(platform, monitor, job_id)

    # Its creator reads the run as before: its series, its summary, its life.
    after = await ask(nc, GET_RUN, GetRun(job_id=job_id), ALICE, RunView)
    assert after == before
    page = await ask(nc, GET_SERIES, GetSeries(job_id=job_id, name="loss", limit=60), ALICE, SeriesPage)
    assert isinstance(page, SeriesPage) and [p.seq for p in page.points] == list(range(1, 101))
    # To someone who may not view it, it is a job that does not exist, as one that never did.
    reads: list[tuple[Any, Callable[[str], msgspec.Struct], Any]] = [
        (GET_RUN, lambda job: GetRun(job_id=job), RunView),
        (GET_SERIES, lambda job: GetSeries(job_id=job, name="loss"), SeriesPage)]
    for operation, request, reply in reads:
        hidden = await ask(nc, operation, request(job_id), CAROL, reply)
        missing = await ask(nc, operation, request(made_up), CAROL, reply)
        assert isinstance(hidden, CommandError) and isinstance(missing, CommandError)
        assert hidden.code == "not-found" and hidden == msgspec.structs.replace(
            missing, message=missing.message.replace(made_up, job_id))
    # A follow stream's watch of it learns that it ended (nothing more comes of it).
    inbox = f"{inbox_prefix(user_nats_name('alice'))}.follow"
    watching = await ask(nc, WATCH_JOB, WatchJob(job_id=job_id, inbox=inbox), ALICE, Watching)
    assert isinstance(watching, Watching) and watching.status == "succeeded"
    refused = await ask(nc, WATCH_JOB, WatchJob(job_id=job_id, inbox=f"{inbox_prefix(user_nats_name('carol'))}.f"),
                        CAROL, Watching)
    assert isinstance(refused, CommandError) and refused.code == "not-found"
    assert job_id not in monitor.jobs.jobs and job_id not in monitor.state.runs  # read back, not held again


async def test_an_archived_jobs_alerts_and_terminal_answer_as_before_its_archival(
        platform: Platform, nc: Client, nats_url: str, database_url: str) -> None:
    monitor = await platform.start(nats_url, database_url)
    job_id = new_job_id()
    debug = msgspec.structs.replace(SPEC, pool="resilient", checkpoint_resume=CheckpointResume(),
                                    debug_terminal=DebugTerminal(retention="1s"))
    await platform.records("job", job_id, JobSubmitted(job_id=job_id, spec=debug, creator="alice"),
                           JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED),
                           JobFailed(job_id=job_id, reason="rank 0 exited with code 4", exit_code=4))
    [released] = await eventually(lambda: platform.recorded(DebugEnvironmentReleased, job_id))
    assert released.attempt == 1
    alerts: AlertPage = await ask(nc, LIST_ALERTS, ListAlerts(), ALICE, AlertPage)
    assert [e.event.kind for e in alerts.alerts if isinstance(e.event, AlertRaised)] == ["resume-limit"]
    terminal_before = await ask(nc, OPEN_TERMINAL, OpenTerminal(job_id=job_id), ALICE, TerminalOpened)
    assert isinstance(terminal_before, CommandError) and "released at" in terminal_before.message

    await archive(platform, monitor, job_id)

    assert await ask(nc, LIST_ALERTS, ListAlerts(), ALICE, AlertPage) == alerts
    listed = await ask(nc, LIST_ALERTS, ListAlerts(), CAROL, AlertPage)
    assert isinstance(listed, AlertPage) and listed.alerts == []
    assert await ask(nc, OPEN_TERMINAL, OpenTerminal(job_id=job_id), ALICE, TerminalOpened) == terminal_before
    stranger = await ask(nc, OPEN_TERMINAL, OpenTerminal(job_id=job_id), CAROL, TerminalOpened)
    assert isinstance(stranger, CommandError) and stranger.code == "not-found"


async def test_an_archived_job_is_read_back_after_a_restart_and_a_command_on_it_later_counts(
        platform: Platform, nc: Client, nats_url: str, database_url: str) -> None:
    """Where the scheduler's events about an archived job are is written beside the monitor's log: a monitor started
    again reads the job back as before, and an administrator's deletion of it, recorded after, is read with it."""
    monitor = await platform.start(nats_url, database_url)
    job_id = new_job_id()
    await platform.records("job", job_id, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"),
                           JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED))
    await platform.records("launch", job_id, NodeProcessStarted(job_id=job_id, attempt=1, rank=0, node="node-a",
                                                                pid=7, started_at=AT))
    await platform.records("launch", job_id, NodeProcessExited(job_id=job_id, attempt=1, rank=0, node="node-a",
                                                               exit_code=0, exited_at=AT))
    await platform.records("job", job_id, JobSucceeded(job_id=job_id))
    await eventually(lambda: platform.finished(job_id))
    before = await ask(nc, GET_RUN, GetRun(job_id=job_id), ALICE, RunView)
    assert isinstance(before, RunView) and before.state == "finished"
    await archive(platform, monitor, job_id)
    assert platform.runtime is not None
    await platform.runtime.close()

    monitor = await platform.start(nats_url, database_url)
    assert job_id not in monitor.jobs.jobs
    assert await ask(nc, GET_RUN, GetRun(job_id=job_id), ALICE, RunView) == before
    await platform.records("job", job_id, JobDeleted(job_id=job_id, by="root"))

    async def gone() -> bool:
        answer = await ask(nc, GET_RUN, GetRun(job_id=job_id), ALICE, RunView)
        return isinstance(answer, CommandError) and answer.code == "not-found"

    await eventually(gone)
