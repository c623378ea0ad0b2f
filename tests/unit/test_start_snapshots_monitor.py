"""The monitor's state saved in a snapshot and loaded back: its nodes, pre-checks, incidents, kept environments,
alerts awaiting their mail, released instances, caches and runs; the scheduler's jobs as it folded them, each
node's latest cache report and the attempts it watches for performance. Loaded into the maps its parts read, every
node with a full grace period; folded on from any point of a history, it ends where folding all of it ends."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from libs.contracts.cluster import NodeInfo
from libs.contracts.datacache import CacheEntry, CacheEviction, CacheReport
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    ComponentMarked,
    DatasetCached,
    DatasetEvicted,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    Event,
    EventEnvelope,
    InstanceReleased,
    JobAdmitted,
    JobArchived,
    JobFailed,
    JobSubmitted,
    NodeLost,
    NodeRegistered,
    NodeUnhealthy,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
    RunBegan,
    RunContinued,
    RunFinished,
    RunProcessEnded,
    SettingsChanged,
)
from libs.contracts.health import ComponentHealth, NodeCheck
from libs.contracts.jobspec import CheckpointResume, DebugTerminal, PerformanceDetection
from libs.contracts.scheduling import AdminSettings
from services.monitor.service import Monitor
from tests.support.monitor import unstarted_monitor
from tests.support.specs import sleeper

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
SPEC = msgspec.structs.replace(
    sleeper("watched"), project="vision", pool="resilient",
    checkpoint_resume=CheckpointResume(performance=PerformanceDetection(threshold=0.8, window=2)),
    debug_terminal=DebugTerminal(retention="1h"))
A, B = "job-00000000000a", "job-00000000000b"
KEY = "0123456789abcdef01234567"


monitor = unstarted_monitor


class Log:
    """Envelopes as the monitor's log and the streams it follows hold them, folded as the monitor folds them."""

    def __init__(self) -> None:
        self.versions: dict[tuple[str, str, str], int] = {}
        self.position = 0

    def envelope(self, service: str, aggregate_type: str, aggregate_id: str, event: Event) -> EventEnvelope:
        key = (service, aggregate_type, aggregate_id)
        self.versions[key] = self.versions.get(key, 0) + 1
        self.position += 1
        return EventEnvelope(event_id=f"{service}-{self.position}", service=service, aggregate_type=aggregate_type,
                             aggregate_id=aggregate_id, version=self.versions[key], position=self.position,
                             recorded_at=NOW + timedelta(seconds=self.position), event=event)

    def scheduler(self, watched: Monitor, job_id: str, event: Event) -> None:
        aggregate = ("settings", "platform") if isinstance(event, SettingsChanged) else ("job", job_id)
        watched.follow(self.envelope("scheduler", *aggregate, event))

    def own(self, watched: Monitor, aggregate_type: str, aggregate_id: str, event: Event) -> None:
        watched.apply(self.envelope("monitor", aggregate_type, aggregate_id, event))


def node(name: str) -> NodeInfo:
    return NodeInfo(name=name, address="10.0.0.1", cpus=8.0, memory_mib=16384)


def entry(at: datetime) -> CacheEntry:
    return CacheEntry(key=KEY, source="datasets/imagenet", bytes=10, files=1, staged_at=at, last_used=at)


def admitted(job_id: str, *nodes: str) -> JobAdmitted:
    return JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-1",
                       placement=[Placement(rank=r, node=n, address="10.0.0.1", slots=1) for r, n in enumerate(nodes)])


# Each step folds into a monitor what the monitor would fold: its own events, the scheduler's, the autoscaler's
# and a node's cache report.
Step = Callable[[Log, Monitor], None]
STORY: list[Step] = [
    lambda log, m: log.scheduler(m, "", SettingsChanged(settings=AdminSettings(debug_retention="2h"), by="root")),
    lambda log, m: log.own(m, "node", "node-a", NodeRegistered(node=node("node-a"))),
    lambda log, m: log.own(m, "node", "node-b", NodeRegistered(node=node("node-b"))),
    lambda log, m: log.own(m, "node", "node-b", ComponentMarked(node_name="node-b", component="board:0",
                                                                faulty=True, by="root", reason="xid")),
    lambda log, m: log.own(m, "node", "node-b", NodeUnhealthy(node_name="node-b", problems=["board:0"])),
    lambda log, m: log.scheduler(m, A, JobSubmitted(job_id=A, spec=SPEC, creator="alice")),
    lambda log, m: log.scheduler(m, B, JobSubmitted(job_id=B, spec=SPEC, creator="bob")),
    lambda log, m: log.own(m, "job", A, PrecheckCompleted(job_id=A, attempt=1, passed=True, nodes=[
        NodeCheck(node="node-a", passed=True, checks=[ComponentHealth(kind="board", name="0", healthy=True)])])),
    lambda log, m: log.scheduler(m, A, admitted(A, "node-a")),
    lambda log, m: log.scheduler(m, B, admitted(B, "node-a", "node-b")),
    lambda log, m: log.own(m, "run", A, RunBegan(job_id=A, attempt=1, began_at=NOW)),
    lambda log, m: log.own(m, "run", B, RunBegan(job_id=B, attempt=1, began_at=NOW)),
    lambda log, m: log.own(m, "job", A, PerformanceDegraded(job_id=A, attempt=1, node="node-a", rank=0, ratio=0.5,
                                                            threshold=0.8, direction="below", window=2,
                                                            action="alert")),
    lambda log, m: log.own(m, "alert", "a-1", AlertRaised(alert_id="a-1", kind="performance", title="slow",
                                                          message="", recipients=["alice@example.com"], job_id=A)),
    lambda log, m: log.own(m, "alert", "a-2", AlertRaised(alert_id="a-2", kind="node-lost", title="lost",
                                                          message="", recipients=["ops@example.com"])),
    lambda log, m: log.own(m, "alert", "a-2", AlertMailed(alert_id="a-2", recipients=["ops@example.com"])),
    lambda log, m: log.own(m, "cache", "node-a", DatasetCached(node="node-a", entry=entry(NOW))),
    lambda log, m: m.reports.update({"node-a": CacheReport(node="node-a", sent_at=NOW, entries=[entry(NOW)])}),
    lambda log, m: log.own(m, "run", B, RunProcessEnded(job_id=B, attempt=1, task=0, rank=1, node="node-b",
                                                        exit_code=1, ended_at=NOW)),
    lambda log, m: log.scheduler(m, B, JobFailed(job_id=B, reason="exit 1")),
    lambda log, m: log.own(m, "run", B, RunFinished(job_id=B, attempt=1, by="the job failed", finished_at=NOW)),
    lambda log, m: log.own(m, "job", B, DebugEnvironmentKept(job_id=B, attempt=1, nodes=["node-a", "node-b"],
                                                             until=NOW + timedelta(hours=2))),
    lambda log, m: log.own(m, "node", "node-b", NodeLost(node_name="node-b", last_seen=NOW, reason="silent")),
    lambda log, m: m.state.apply_autoscaler(log.envelope("autoscaler", "instance", "node-b", InstanceReleased(
        instance="node-b", reason="idle"))),
    lambda log, m: log.own(m, "run", A, RunContinued(job_id=A, attempt=2)),
    lambda log, m: log.own(m, "cache", "node-a", DatasetEvicted(node="node-a", eviction=CacheEviction(
        key=KEY, source="datasets/imagenet", bytes=10, cause="retention", evicted_at=NOW))),
    lambda log, m: log.own(m, "job", B, DebugEnvironmentReleased(job_id=B, attempt=1)),
    lambda log, m: log.scheduler(m, B, JobArchived(job_id=B, retention="1h")),
]


def told(watched: Monitor) -> list[Any]:
    """What the monitor's parts read of it."""
    return [watched.save_state(), sorted(watched.state._incident_keys.items()), dict(watched.state.keeping),
            [(name, n.lost, n.problems, n.marks, n.probed) for name, n in watched.state.nodes.items()],
            [(job_id, watched.detector.watching(job_id)) for job_id in (A, B)], watched.jobs.settings]


def test_a_monitor_loaded_from_its_snapshot_holds_what_it_held_in_the_maps_its_parts_read() -> None:
    log, held = Log(), monitor()
    for step in STORY:
        step(log, held)
    held.state.nodes["node-a"].probed = [ComponentHealth(kind="board", name="0", healthy=True)]  # a heartbeat's
    assert held.state.keeping == {} and (A, 1, 0) in held.state.incidents and held.state.unmailed
    assert held.detector.watching(A) and held.state.released == {"node-b": "idle"}

    loaded = monitor()
    maps = (loaded.state.nodes, loaded.state.incidents, loaded.state.keeping, loaded.jobs, loaded.reports)
    loaded.load_state(held.save_state())
    assert (loaded.state.nodes, loaded.state.incidents, loaded.state.keeping, loaded.jobs, loaded.reports) == maps
    assert all(a is b for a, b in zip(maps, (loaded.state.nodes, loaded.state.incidents, loaded.state.keeping,
                                             loaded.jobs, loaded.reports), strict=True))
    assert loaded.detector.recorded is loaded.state.incidents and loaded.retention.kept is loaded.state.keeping
    assert loaded.save_state() == held.save_state()
    # Not of the log: a node's last heartbeat and probe. Each is seen as it is loaded, and probed again.
    assert all(n.probed is None and n.last_seen > 0 for n in loaded.state.nodes.values())
    held.state.nodes["node-a"].probed = None
    assert told(loaded)[1:] == told(held)[1:]


def test_every_cut_of_a_history_folded_on_from_its_snapshot_ends_where_the_whole_history_ends() -> None:
    log, everything = Log(), monitor()
    for step in STORY:
        step(log, everything)
    for cut in range(len(STORY) + 1):
        part, before = Log(), monitor()
        for step in STORY[:cut]:
            step(part, before)
        restored = monitor()
        restored.load_state(before.save_state())
        restored.versions = dict(before.versions)
        for step in STORY[cut:]:
            step(part, restored)
        assert told(restored) == told(everything), cut
        assert restored.versions == everything.versions, cut


def test_a_snapshot_of_a_monitor_that_mailed_is_refused_by_one_that_does_not() -> None:
    log, mailing = Log(), monitor()
    for step in STORY:
        step(log, mailing)
    silent = monitor(smtp_url=None)
    before = silent.save_state()
    with pytest.raises(ValueError, match="with mail"):
        silent.load_state(mailing.save_state())
    assert silent.save_state() == before  # nothing changed
