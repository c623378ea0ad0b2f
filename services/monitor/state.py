"""The monitor's own state, folded from its log: nodes, per-job records, runs and alerts.

Nodes: registration, lost or not, the administrator's component marks and the problems last
recorded (empty when healthy); when each was last heard from and its latest probe are kept in
memory only. Jobs (aggregate "job"): pre-checks done, performance incidents recorded, environments
kept for the debug terminal. Runs (aggregate "run"): the life of each job's run (`runs.runlife`). Alerts
(aggregate "alert"): which still await their mail. The version of every aggregate is kept by the service
base (`libs.skeleton.eventsourced`).

What is held of a job goes once the scheduler archives it (`forget_job`, on JobArchived), so that the state
holds the jobs still running or ended within the retention, not every job there ever was. An alert waiting
for its mail stays until it is mailed, whatever became of its job: its creator is owed the mail.

A snapshot holds the state as it stands but for what is not of the log (`saved`, `load`; libs.skeleton.snapshots):
the nodes' last heartbeats and probes are not kept, and a state loaded gives every node a full grace period, as a
rebuild does. It is loaded into the same maps, which the retention and the performance detector read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

import msgspec

from libs.contracts.cluster import NodeInfo
from libs.contracts.datacache import CacheEntry
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    ComponentMarked,
    DatasetCached,
    DatasetEvicted,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    EventEnvelope,
    InstanceReleased,
    InstanceRequested,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeHealthy,
    NodeLost,
    NodeRecovered,
    NodeRegistered,
    NodeRetired,
    NodeUnhealthy,
    PerformanceDegraded,
    PrecheckCompleted,
    RunFinished,
    RunProcessEnded,
)
from libs.contracts.health import ComponentHealth
from services.monitor.kept import KeptEnvironment
from services.monitor.performance.detector import RankKey
from services.monitor.runs import runlife
from services.monitor.runs.runlife import RunLife

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class MonitoredNode:
    info: NodeInfo
    lost: bool = False
    marks: dict[str, ComponentMarked] = field(default_factory=dict)  # faulty marks by component
    problems: list[str] = field(default_factory=list)  # as last recorded; empty when healthy
    last_seen: float = 0.0  # monotonic seconds; not part of the event log
    probed: list[ComponentHealth] | None = None  # the latest heartbeat's probe; None until one arrives
    disk_pressure: str | None = None  # D1: as last recorded; its disk takes no new work

    @property
    def name(self) -> str:
        return self.info.name


@dataclass
class PendingMail:
    alert: AlertRaised
    trace: dict[str, str]


@dataclass
class MonitorState:
    nodes: dict[str, MonitoredNode] = field(default_factory=dict)
    prechecked: dict[str, set[int]] = field(default_factory=dict)  # job -> its attempts pre-checked
    incidents: dict[RankKey, int] = field(default_factory=dict)  # performance incidents recorded
    kept: dict[str, KeptEnvironment] = field(default_factory=dict)  # released ones too, until the job is archived
    keeping: dict[str, KeptEnvironment] = field(default_factory=dict)  # those of `kept` not released yet
    unmailed: dict[str, PendingMail] = field(default_factory=dict)
    # Whether alerts are mailed at all: without mail nothing awaits its mail, and none is kept for it.
    mailing: bool = True
    # Instances the autoscaler released (instance, i.e. node -> why) whose node is not retired yet: one a job
    # ran on when its instance vanished is retired once it is counted lost.
    released: dict[str, str] = field(default_factory=dict)
    # D1, D2: each node's dataset cache as recorded (DatasetCached, DatasetEvicted), by entry key.
    cached: dict[str, dict[str, CacheEntry]] = field(default_factory=dict)
    runs: dict[str, RunLife] = field(default_factory=dict)  # R1: each job's run, once it began
    # The stream sequences of the scheduler's events about each job held, in order: indexed once it is archived
    # (runs/archive.py), when they are where its history is read back from.
    published: dict[str, list[int]] = field(default_factory=dict)
    # The keys of `incidents` by job, so that an archived job's are found without a walk over all of them.
    _incident_keys: dict[str, set[RankKey]] = field(default_factory=dict, init=False, repr=False)

    def apply(self, envelope: EventEnvelope, now: float) -> None:
        if envelope.aggregate_type == "node":
            self._apply_node(envelope, now)
        elif envelope.aggregate_type == "job":
            self._apply_job(envelope)
        elif envelope.aggregate_type == "alert":
            self._apply_alert(envelope)
        elif envelope.aggregate_type == "run":
            runlife.fold(self.runs, envelope)
        elif isinstance(envelope.event, DatasetCached):
            self.cached.setdefault(envelope.event.node, {})[envelope.event.entry.key] = envelope.event.entry
        elif isinstance(envelope.event, DatasetEvicted):
            self.cached.get(envelope.event.node, {}).pop(envelope.event.eviction.key, None)

    def _apply_node(self, envelope: EventEnvelope, now: float) -> None:
        event = envelope.event
        if isinstance(event, NodeRegistered):
            previous = self.nodes.get(event.node.name)
            node = MonitoredNode(info=event.node, last_seen=now)
            if previous is not None:  # new resources; marks and health stay
                node.marks, node.problems = previous.marks, previous.problems
                node.last_seen, node.probed = previous.last_seen, previous.probed
            self.nodes[event.node.name] = node
            return
        if isinstance(event, NodeRetired):
            self.nodes.pop(envelope.aggregate_id, None)  # no heartbeat is awaited from it any more
            self.released.pop(envelope.aggregate_id, None)
            return
        found = self.nodes.get(envelope.aggregate_id)
        if found is None:
            return
        if isinstance(event, NodeLost):
            found.lost = True
        elif isinstance(event, NodeRecovered):
            found.lost = False
            found.last_seen = now
        elif isinstance(event, NodeUnhealthy):
            found.problems = list(event.problems)
        elif isinstance(event, NodeHealthy):
            found.problems = []
        elif isinstance(event, NodeDiskPressure | NodeDiskRelieved):
            found.disk_pressure = event.reason if isinstance(event, NodeDiskPressure) else None
        elif isinstance(event, ComponentMarked):
            if event.faulty:
                found.marks[event.component] = event
            else:
                found.marks.pop(event.component, None)

    def apply_autoscaler(self, envelope: EventEnvelope) -> None:
        """Fold the autoscaler's events: which instances it released."""
        event = envelope.event
        if isinstance(event, InstanceReleased) and event.instance in self.nodes:
            self.released[event.instance] = event.reason
        elif isinstance(event, InstanceRequested):  # a name is never reused; a request starts its story anew
            self.released.pop(event.instance, None)

    def _apply_job(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, PrecheckCompleted):
            self.prechecked.setdefault(event.job_id, set()).add(event.attempt)
        elif isinstance(event, PerformanceDegraded):
            key = (event.job_id, event.attempt, event.rank)
            self.incidents[key] = self.incidents.get(key, 0) + 1
            self._incident_keys.setdefault(event.job_id, set()).add(key)
        elif isinstance(event, DebugEnvironmentKept):
            self.kept[event.job_id] = self.keeping[event.job_id] = KeptEnvironment(
                job_id=event.job_id, attempt=event.attempt, nodes=list(event.nodes), until=event.until,
                trace=envelope.trace)
        elif isinstance(event, DebugEnvironmentReleased):
            kept = self.kept.get(event.job_id)
            if kept is not None and kept.attempt == event.attempt:
                kept.released = True
                self.keeping.pop(event.job_id, None)

    def _apply_alert(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, AlertRaised):
            if event.recipients and self.mailing:
                self.unmailed[event.alert_id] = PendingMail(event, envelope.trace)
        elif isinstance(event, AlertMailed):
            self.unmailed.pop(event.alert_id, None)

    def was_prechecked(self, job_id: str, attempt: int) -> bool:
        return attempt in self.prechecked.get(job_id, ())

    def forget_job(self, job_id: str) -> None:
        """The job was archived: nothing of it is held any more (its alerts awaiting their mail stay until
        mailed)."""
        self.prechecked.pop(job_id, None)
        for key in self._incident_keys.pop(job_id, ()):
            self.incidents.pop(key, None)
        self.kept.pop(job_id, None)
        self.keeping.pop(job_id, None)
        self.runs.pop(job_id, None)
        self.published.pop(job_id, None)

    def overdue(self, now: float, lost_after: float, hearing_since: float = 0.0) -> list[MonitoredNode]:
        """Nodes, not yet marked lost, not heard from for over `lost_after` seconds: since their last
        heartbeat, or since the monitor could hear again (`hearing_since`), whichever is later, so a
        monitor cut off from NATS never counts its own deafness against the nodes."""
        return [n for n in self.nodes.values() if not n.lost and now - max(n.last_seen, hearing_since) > lost_after]

    # --- snapshots --------------------------------------------------------------------------------------

    def saved(self) -> SavedMonitorState:
        """The state as a snapshot holds it (sets in one order, so that equal states save the same bytes)."""
        return SavedMonitorState(
            mailing=self.mailing,
            nodes=[_SavedNode(node.info, node.lost, node.marks, node.problems, node.disk_pressure)
                   for node in self.nodes.values()],
            prechecked={job_id: sorted(attempts) for job_id, attempts in self.prechecked.items()},
            incidents=[(*key, count) for key, count in self.incidents.items()], kept=list(self.kept.values()),
            keeping=list(self.keeping), unmailed=self.unmailed, released=self.released, cached=self.cached,
            runs={job_id: _SavedRun(life.began_at, life.attempts, list(life.ended.values()), life.finished)
                  for job_id, life in self.runs.items()},
            published=self.published)

    def load(self, saved: SavedMonitorState, now: float) -> None:
        """Put in place, in the maps others read, what `saved` holds; every node seen `now`. A snapshot of a monitor
        that mailed alerts, or did not, when this one does not, or does, holds other alerts awaiting their mail than
        its log would give: it is refused (ValueError), nothing changed."""
        if saved.mailing != self.mailing:
            raise ValueError(f"a snapshot of a monitor {'with' if saved.mailing else 'without'} mail")
        kept = {environment.job_id: environment for environment in saved.kept}
        _replace(self.nodes, {node.info.name: MonitoredNode(info=node.info, lost=node.lost, marks=node.marks,
                                                            problems=node.problems, last_seen=now,
                                                            disk_pressure=node.disk_pressure)
                              for node in saved.nodes})
        _replace(self.prechecked, {job_id: set(attempts) for job_id, attempts in saved.prechecked.items()})
        _replace(self.incidents, {(job_id, attempt, rank): count for job_id, attempt, rank, count in saved.incidents})
        _replace(self._incident_keys, {})
        for key in self.incidents:
            self._incident_keys.setdefault(key[0], set()).add(key)
        _replace(self.kept, kept)
        _replace(self.keeping, {job_id: kept[job_id] for job_id in saved.keeping})
        _replace(self.unmailed, saved.unmailed)
        _replace(self.released, saved.released)
        _replace(self.cached, saved.cached)
        _replace(self.runs, {job_id: RunLife(began_at=run.began_at, attempts=run.attempts,
                                             ended={(e.attempt, e.task, e.rank): e for e in run.ended},
                                             finished=run.finished)
                             for job_id, run in saved.runs.items()})
        _replace(self.published, saved.published)

    def kept_environment(self, job_id: str, now: datetime) -> KeptEnvironment | None:
        """The job's kept environment, if it has one and its retention is not over."""
        kept = self.kept.get(job_id)
        return kept if kept is not None and not kept.released and kept.until > now else None



def _replace(held: dict[K, V], saved: dict[K, V]) -> None:
    held.clear()
    held.update(saved)


class _SavedNode(msgspec.Struct, array_like=True):
    info: NodeInfo
    lost: bool
    marks: dict[str, ComponentMarked]
    problems: list[str]
    disk_pressure: str | None


class _SavedRun(msgspec.Struct, array_like=True):
    began_at: datetime
    attempts: list[int]
    ended: list[RunProcessEnded]  # in the order they ended
    finished: RunFinished | None


class SavedMonitorState(msgspec.Struct, array_like=True):
    mailing: bool
    nodes: list[_SavedNode]
    prechecked: dict[str, list[int]]
    incidents: list[tuple[str, int, int, int]]  # (job, attempt, rank, incidents)
    kept: list[KeptEnvironment]
    keeping: list[str]  # those of `kept` not released yet
    unmailed: dict[str, PendingMail]
    released: dict[str, str]
    cached: dict[str, dict[str, CacheEntry]]
    runs: dict[str, _SavedRun]
    published: dict[str, list[int]]
