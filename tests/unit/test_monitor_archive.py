"""Archived jobs and the monitor: once the scheduler archives a job, nothing of it stays in the monitor's memory
(however many jobs pass, what it holds stays the same), a job still running keeps all it had, and the questions
about an archived job are answered from its history read back (`services.monitor.runs.archive`)."""

from __future__ import annotations

import asyncio
import types
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from libs.contracts.agent import LogChunk
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    Event,
    EventEnvelope,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobFailed,
    JobPrechecking,
    JobSubmitted,
    JobSucceeded,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
    RunBegan,
    RunFinished,
    RunProcessEnded,
)
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import CheckpointResume, DebugTerminal, PerformanceDetection
from libs.contracts.operations.alerts import ListAlerts
from libs.contracts.operations.runs import OpenTerminal
from libs.contracts.operations.watches import WatchJob
from libs.jobstatus import JobLifecycle
from libs.natsroles import inbox_prefix, user_nats_name
from services.monitor import alerts, terminal
from services.monitor.runs.archive import PastJobs, fold_past
from services.monitor.service import Monitor
from tests.support.monitor import unstarted_monitor
from tests.support.specs import sleeper

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
ALICE = Identity(user="alice", projects=["vision"])
CAROL = Identity(user="carol", projects=["nlp"])
SPEC = msgspec.structs.replace(
    sleeper("slow-and-failing"), project="vision", access="none", pool="resilient",
    checkpoint_resume=CheckpointResume(performance=PerformanceDetection(threshold=0.8, window=2)),
    debug_terminal=DebugTerminal(retention="1h"))
PLACED = [Placement(rank=0, node="node-a", address="127.0.0.1", slots=1)]


monitor = unstarted_monitor


class Log:
    """Envelopes as the scheduler's and the monitor's logs would hold them, numbered per aggregate."""

    def __init__(self) -> None:
        self.versions: dict[tuple[str, str, str], int] = {}
        self.position = 0
        self.left: list[int] = []  # what the last scheduler event left to be written down (`Monitor.follow`)

    def envelope(self, service: str, aggregate_type: str, aggregate_id: str, event: Event) -> EventEnvelope:
        key = (service, aggregate_type, aggregate_id)
        self.versions[key] = self.versions.get(key, 0) + 1
        self.position += 1
        return EventEnvelope(event_id=f"{service}-{self.position}", service=service, aggregate_type=aggregate_type,
                             aggregate_id=aggregate_id, version=self.versions[key], position=self.position,
                             recorded_at=NOW, event=event)

    def scheduler(self, watched: Monitor, job_id: str, event: Event) -> EventEnvelope:
        """The scheduler's event, folded as if stored at the stream sequence of its position."""
        envelope = self.envelope("scheduler", "job", job_id, event)
        self.left = watched.follow(envelope, envelope.position)
        return envelope

    def own(self, watched: Monitor, aggregate_type: str, aggregate_id: str, event: Event) -> EventEnvelope:
        envelope = self.envelope("monitor", aggregate_type, aggregate_id, event)
        watched.apply(envelope)
        return envelope


def alert(alert_id: str, job_id: str, *, mailed_to: list[str] | None = None) -> AlertRaised:
    return AlertRaised(alert_id=alert_id, kind="resume-limit", title=alert_id, message="", job_id=job_id,
                       recipients=["alice@example.com"] if mailed_to is None else mailed_to)


def reachable(watched: Monitor) -> Iterator[object]:
    """Everything the monitor holds (but its connections and tracer), once each."""
    roots = [value for name, value in vars(watched).items() if name not in ("rt", "_tracer")]
    seen: set[int] = set()
    stack: list[object] = list(roots)
    while stack:
        found = stack.pop()
        if id(found) in seen or isinstance(found, type | types.ModuleType | types.FunctionType | types.MethodType
                                           | types.BuiltinFunctionType):
            continue
        seen.add(id(found))
        yield found
        if isinstance(found, dict):
            stack += [*found.keys(), *found.values()]
        elif isinstance(found, list | tuple | set | frozenset | deque):
            stack += list(found)
        elif isinstance(found, msgspec.Struct):
            stack += [getattr(found, name) for name in found.__struct_fields__]
        else:
            stack += list(getattr(found, "__dict__", {}).values())
            stack += [getattr(found, slot) for cls in type(found).__mro__ for slot in getattr(cls, "__slots__", ())
                      if isinstance(slot, str) and hasattr(found, slot)]


def mentions(watched: Monitor, job_id: str) -> list[str]:
    return [text for text in reachable(watched) if isinstance(text, str) and job_id in text]


def entries(watched: Monitor) -> int:
    """How many entries all the monitor's collections hold together."""
    return sum(len(found) for found in reachable(watched) if isinstance(found, dict | list | set | deque))


def live_a_whole_life(watched: Monitor, log: Log, job_id: str) -> None:
    """A checkpoint-resume, debug-terminal job: pre-checked, admitted, slow (an incident and its alert), watched,
    failed (its environment kept, an alert), its environment released."""
    log.scheduler(watched, job_id, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice",
                                                creator_email="alice@example.com"))
    log.scheduler(watched, job_id, JobPrechecking(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED))
    log.own(watched, "job", job_id, PrecheckCompleted(job_id=job_id, attempt=1, passed=True, nodes=[]))
    log.scheduler(watched, job_id, JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED))
    log.own(watched, "run", job_id, RunBegan(job_id=job_id, attempt=1, began_at=NOW))
    slow = LogChunk(job_id=job_id, attempt=1, rank=0, node="node-a", seq=0,
                    lines=["this iteration hardware time is 9 and e2e time is 10 ms"] * 2)
    assert watched.detector.feed(slow)  # its window opened an incident
    log.own(watched, "job", job_id, PerformanceDegraded(job_id=job_id, attempt=1, node="node-a", rank=0, ratio=0.9,
                                                        threshold=0.8, direction="above", window=2, action="alert"))
    slow_alert = f"performance-{job_id}-1-0-1"
    log.own(watched, "alert", slow_alert, alert(slow_alert, job_id))
    log.own(watched, "alert", slow_alert, AlertMailed(alert_id=slow_alert, recipients=["alice@example.com"]))
    watch = WatchJob(job_id=job_id, inbox=f"{inbox_prefix(user_nats_name('alice'))}.w1", logs=True)
    assert watched.watching.watches.ask(watch, "alice", 0.0) is True
    watched.watching.watches.saw_log(job_id, 41)
    log.own(watched, "run", job_id, RunProcessEnded(job_id=job_id, attempt=1, task=0, rank=0, node="node-a",
                                                    exit_code=4, ended_at=NOW))
    log.scheduler(watched, job_id, JobFailed(job_id=job_id, reason="rank 0 exited with code 4", exit_code=4))
    log.own(watched, "run", job_id, RunFinished(job_id=job_id, attempt=1, by="the job failed", finished_at=NOW))
    log.own(watched, "job", job_id, DebugEnvironmentKept(job_id=job_id, attempt=1, nodes=["node-a"],
                                                         until=NOW + timedelta(hours=1)))
    failed_alert = f"job-failed-{job_id}"
    log.own(watched, "alert", failed_alert, alert(failed_alert, job_id, mailed_to=[]))
    log.own(watched, "job", job_id, DebugEnvironmentReleased(job_id=job_id, attempt=1))


def test_an_archived_job_leaves_nothing_in_the_monitor_and_a_running_job_keeps_all_it_had() -> None:
    watched, log = monitor(), Log()
    archived, running = new_job_id(), new_job_id()
    live_a_whole_life(watched, log, archived)
    log.scheduler(watched, running, JobSubmitted(job_id=running, spec=SPEC, creator="bob"))
    log.own(watched, "job", running, PrecheckCompleted(job_id=running, attempt=1, passed=True, nodes=[]))
    log.scheduler(watched, running, JobAdmitted(job_id=running, attempt=1, flavor="cpu-1", placement=PLACED))
    log.own(watched, "run", running, RunBegan(job_id=running, attempt=1, began_at=NOW))
    watch = WatchJob(job_id=running, inbox=f"{inbox_prefix(user_nats_name('bob'))}.w1")
    assert watched.watching.watches.ask(watch, "bob", 0.0) is True
    assert mentions(watched, archived)  # it is held before it is archived
    held = entries(watched)

    noted = list(watched.state.published[archived])
    archival = log.scheduler(watched, archived, JobArchived(job_id=archived, retention="1m"))

    assert log.left == [*noted, archival.position]  # where its history is, to be written down
    assert mentions(watched, archived) == []
    assert entries(watched) < held
    # The running job keeps its record, pre-check, run, watch, watched attempt and versions.
    assert watched.jobs.jobs[running].status == "running"
    assert watched.state.was_prechecked(running, 1) and running in watched.state.runs
    assert watched.detector.watching(running) and len(watched.watching.watches.of(running)) == 1
    assert watched.version("run", running) == 1 and watched.version("job", running) == 1


def test_memory_holds_the_same_whether_a_thousand_jobs_passed_or_a_hundred() -> None:
    watched, log = monitor(), Log()

    def one_job_passes() -> None:
        job_id = new_job_id()
        log.scheduler(watched, job_id, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"))
        log.scheduler(watched, job_id, JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED))
        log.own(watched, "run", job_id, RunBegan(job_id=job_id, attempt=1, began_at=NOW))
        log.own(watched, "job", job_id, PrecheckCompleted(job_id=job_id, attempt=1, passed=True, nodes=[]))
        log.scheduler(watched, job_id, JobSucceeded(job_id=job_id))
        log.own(watched, "run", job_id, RunFinished(job_id=job_id, attempt=1, by="rank 0 ended", finished_at=NOW))
        log.own(watched, "alert", f"job-failed-{job_id}", alert(f"job-failed-{job_id}", job_id, mailed_to=[]))
        log.scheduler(watched, job_id, JobArchived(job_id=job_id, retention="1m"))

    for _ in range(100):
        one_job_passes()
    after_a_hundred = entries(watched)
    for _ in range(900):
        one_job_passes()
    assert entries(watched) == after_a_hundred
    assert watched.versions == {} and watched.jobs.jobs == {} and watched.state.runs == {}


def test_an_alert_awaiting_its_mail_outlives_its_job_until_mailed_and_without_mail_none_waits() -> None:
    watched, log = monitor(), Log()
    job_id = new_job_id()
    log.scheduler(watched, job_id, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"))
    alert_id = f"job-failed-{job_id}"
    log.own(watched, "alert", alert_id, alert(alert_id, job_id))
    log.scheduler(watched, job_id, JobArchived(job_id=job_id, retention="1m"))
    assert list(watched.state.unmailed) == [alert_id] and watched.version("alert", alert_id) == 1  # still owed
    log.own(watched, "alert", alert_id, AlertMailed(alert_id=alert_id, recipients=["alice@example.com"]))
    assert mentions(watched, job_id) == []

    unmailing, log = monitor(smtp_url=None), Log()
    log.own(unmailing, "alert", alert_id, alert(alert_id, job_id))
    assert unmailing.state.unmailed == {} and unmailing.versions == {}


def history(job_id: str, *extra: Event) -> list[EventEnvelope]:
    """A failed debug-terminal job's events as published: the scheduler's, the monitor's about the job and its run,
    then its archival."""
    log = Log()
    scheduler: list[Event] = [JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"),
                              JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1", placement=PLACED),
                              JobFailed(job_id=job_id, reason="rank 0 exited with code 4", exit_code=4)]
    return [*(log.envelope("scheduler", "job", job_id, e) for e in scheduler),
            log.envelope("monitor", "run", job_id, RunBegan(job_id=job_id, attempt=1, began_at=NOW)),
            log.envelope("monitor", "run", job_id, RunFinished(job_id=job_id, attempt=1, by="the job failed",
                                                               finished_at=NOW)),
            log.envelope("monitor", "job", job_id, DebugEnvironmentKept(job_id=job_id, attempt=1, nodes=["node-a"],
                                                                        until=NOW + timedelta(hours=1))),
            log.envelope("monitor", "job", job_id, DebugEnvironmentReleased(job_id=job_id, attempt=1)),
            *(log.envelope("scheduler", "job", job_id, e) for e in extra)]


def test_an_archived_job_is_read_back_as_it_was_before_its_archival_and_only_an_archived_one() -> None:
    job_id = new_job_id()
    past = fold_past(job_id, history(job_id, JobArchived(job_id=job_id, retention="1m")))
    assert past is not None and past.job.archived
    assert (past.job.status, past.job.creator, list(past.job.nodes_used)) == ("failed", "alice", ["node-a"])
    assert past.life is not None and past.life.finished is not None and past.life.attempts == [1]
    assert past.kept is not None and past.kept.released
    assert past.viewable(ALICE, JobLifecycle().settings) is past.job
    assert past.viewable(CAROL, JobLifecycle().settings) is None

    assert fold_past(job_id, history(job_id)) is None  # not archived: the monitor answers it from its state
    assert fold_past(new_job_id(), history(job_id, JobArchived(job_id=job_id, retention="1m"))) is None
    # An administrator deleted it after its archival: it is not shown any more.
    deleted = fold_past(job_id, history(job_id, JobArchived(job_id=job_id, retention="1m"),
                                        JobDeleted(job_id=job_id, by="root")))
    assert deleted is not None and deleted.viewable(ALICE, JobLifecycle().settings) is None


def test_the_alerts_of_an_archived_job_are_read_by_those_who_may_view_it() -> None:
    job_id = new_job_id()
    past = fold_past(job_id, history(job_id, JobArchived(job_id=job_id, retention="1m")))
    assert past is not None
    raised = [Log().envelope("monitor", "alert", "a", alert("a", job_id))]
    jobs = JobLifecycle()  # it is no longer held
    assert alerts.jobs_to_look_up(raised, ListAlerts(), ALICE, jobs) == [job_id]
    assert alerts.jobs_to_look_up(raised, ListAlerts(), Identity(user="root", projects=[], admin=True), jobs) == []
    assert alerts.page(raised, ListAlerts(), ALICE, jobs).alerts == []  # as it was before it could be read back
    assert len(alerts.page(raised, ListAlerts(), ALICE, jobs, {job_id: past.job}).alerts) == 1
    assert alerts.page(raised, ListAlerts(), CAROL, jobs, {job_id: past.job}).alerts == []


def test_an_archived_jobs_terminal_is_refused_as_its_retention_is_over_and_a_stranger_finds_no_job() -> None:
    job_id, made_up = new_job_id(), new_job_id()
    past = fold_past(job_id, history(job_id, JobArchived(job_id=job_id, retention="1m")))
    jobs = JobLifecycle()
    over = terminal.archived_refusal(OpenTerminal(job_id=job_id), ALICE, past, jobs, NOW + timedelta(days=8))
    assert over.code == "invalid-state" and "released at 2026-11-25 13:00:00 UTC" in over.message
    hidden = terminal.archived_refusal(OpenTerminal(job_id=job_id), CAROL, past, jobs, NOW)
    missing = terminal.archived_refusal(OpenTerminal(job_id=made_up), ALICE, None, jobs, NOW)
    assert hidden.code == "not-found" and hidden == msgspec.structs.replace(
        missing, message=missing.message.replace(made_up, job_id))


async def test_an_archived_job_read_back_is_read_again_once_an_event_of_it_comes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command on an archived job (an administrator deletes it) records an event: the job is read back anew."""
    job_id = new_job_id()
    stream = history(job_id, JobArchived(job_id=job_id, retention="1m"))
    reads: list[str] = []

    async def read_back(_: object, job_id: str) -> list[EventEnvelope]:
        reads.append(job_id)
        await asyncio.sleep(0)
        return list(stream)

    monkeypatch.setattr(PastJobs, "history", read_back)
    past = PastJobs(js=None, store=None, index=None)  # type: ignore[arg-type]
    first = await past.find(job_id)
    assert first is not None and first.viewable(ALICE, JobLifecycle().settings) is not None
    assert await past.find(job_id) is first and len(reads) == 1  # kept: not read again
    stream.append(Log().envelope("scheduler", "job", job_id, JobDeleted(job_id=job_id, by="root")))
    past.changed(job_id)
    again = await past.find(job_id)
    assert again is not None and again.viewable(ALICE, JobLifecycle().settings) is None
    assert await past.find("job-*") is None and await past.find(new_job_id().upper()) is None
    assert len(reads) == 2  # nothing is read for what is not a job id
