"""The monitor's rules: what to record for a node, a scheduler event, a pre-check or an incident.

Nothing here does I/O or reads a clock. The service passes in what it knows (the node, its version
as folded so far, the jobs, the settings, `now`) and gets an `Outcome`: the events and the alerts they
raise, recorded in one append, and the workspaces its agents are then asked to release.

An alert's id names its incident (see `alerts`); for a node it is the version of the event that
raised it, so the versions passed in must be the ones the events will be appended at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.cluster import NodeInfo
from libs.contracts.datacache import CacheEntry, CacheEviction, CachePolicy, CacheReport
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
    JobExpired,
    JobFailed,
    JobPrechecking,
    JobResuming,
    JobStopped,
    JobSucceeded,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeEvent,
    NodeHealthy,
    NodeLost,
    NodeRecovered,
    NodeRegistered,
    NodeRetired,
    NodeUnhealthy,
    PerformanceDegraded,
    PrecheckCompleted,
    ProvisionFailed,
    UpstreamMessageSetAside,
)
from libs.contracts.health import NodeCheck
from libs.contracts.jobspec import parse_duration
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.cluster import MarkComponent
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import NewEvent
from libs.jobstatus import JobLifecycle, JobRecord
from services.monitor import alerts
from services.monitor.health import changed, faulty_components, problems_of
from services.monitor.kept import KeptEnvironment
from services.monitor.performance.detector import Incident
from services.monitor.state import MonitoredNode


@dataclass(frozen=True)
class Release:
    """A job's workspaces on `nodes` that nobody needs any more: their agents are asked to remove them."""

    job_id: str
    nodes: list[str]


@dataclass
class Outcome:
    events: list[NewEvent] = field(default_factory=list)
    alerts: list[AlertRaised] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)

    @property
    def changes(self) -> list[NewEvent]:
        """The events, then the alerts they raise: one append."""
        return [*self.events, *(NewEvent("alert", a.alert_id, a) for a in self.alerts)]


# --- nodes (M2) -------------------------------------------------------------------------------------


def health_events(node: MonitoredNode, marks: Mapping[str, ComponentMarked]) -> list[NodeEvent]:
    """NodeUnhealthy when the node's problems appear or change, NodeHealthy when they are gone."""
    problems = problems_of(faulty_components(node.probed, marks, node.problems))
    if problems and changed(node.problems, problems):
        return [NodeUnhealthy(node_name=node.name, problems=problems)]
    if not problems and node.problems:
        return [NodeHealthy(node_name=node.name)]
    return []


def node_changes(name: str, version: int, events: Sequence[NodeEvent], *, was_healthy: bool, jobs: JobLifecycle,
                 operators: Sequence[str]) -> Outcome:
    """Node events at `version` + 1, …; a node turning unhealthy, or lost, raises an alert naming the
    jobs running there (looked up only then: heartbeats are many)."""
    outcome = Outcome(events=[NewEvent("node", name, e) for e in events])
    for number, event in enumerate(events, start=version + 1):  # the event's own version names its alert
        if isinstance(event, NodeUnhealthy) and was_healthy:
            outcome.alerts.append(alerts.node_unhealthy(name, number, event.problems, jobs.running_on(name),
                                                        operators))
        elif isinstance(event, NodeLost):
            outcome.alerts.append(alerts.node_lost(name, number, event.reason, jobs.running_on(name), operators))
    return outcome


def credential_refusal(name: str, credential: str | Exception) -> CommandError | None:
    """Why a registration as `name` is refused, given the node its credential names (or why the credential
    is not valid); None when the credential is for exactly that node."""
    hint = f"ask an administrator for a node credential: trainyard admin node-token {name}"
    if isinstance(credential, Exception):
        return CommandError(code="unauthenticated", message=f"node {name} has no valid node credential: {credential}",
                            hint=f"{hint}, and give it to the agent in TRAINYARD_NODE_TOKEN_FILE")
    if credential != name:
        return CommandError(code="forbidden", message=f"the node credential is for node {credential}, not {name}",
                            hint=f"{hint}; a credential registers only the node it names")
    return None


def registration(info: NodeInfo, known: MonitoredNode | None) -> Outcome:
    """A node registers: new or with new resources, or back after it was lost (never an alert)."""
    if known is None or known.info != info:
        return Outcome(events=[NewEvent("node", info.name, NodeRegistered(node=info))])
    if known.lost:
        return Outcome(events=[NewEvent("node", info.name, NodeRecovered(node_name=info.name))])
    return Outcome()


def heartbeat(node: MonitoredNode, version: int, jobs: JobLifecycle, operators: Sequence[str],
              disk_pressure: str | None = None) -> Outcome:
    """After a heartbeat (its probe already in `node.probed`): back if it was lost, any change of health, and
    its disk coming under pressure or out of it (D1: the agent decides, with its thresholds' hysteresis)."""
    events: list[NodeEvent] = [NodeRecovered(node_name=node.name)] if node.lost else []
    events += health_events(node, node.marks)
    if disk_pressure is not None and node.disk_pressure is None:
        events.append(NodeDiskPressure(node_name=node.name, reason=disk_pressure))
    elif disk_pressure is None and node.disk_pressure is not None:
        events.append(NodeDiskRelieved(node_name=node.name))
    return node_changes(node.name, version, events, was_healthy=not node.problems, jobs=jobs, operators=operators)


def cache_report(report: CacheReport, recorded: Mapping[str, CacheEntry]) -> Outcome:
    """D1, D2: what a node's cache report changes in the log: entries new to it are cached; entries it no
    longer holds are evicted, for the reason the agent gave (or found unreadable, when it gave none). A report
    cut short (a cache of more entries than one report carries) says nothing of the entries it leaves out:
    only the evictions it tells are recorded, and a vanished entry waits for a whole report."""
    held = {entry.key: entry for entry in report.entries}
    events: list[Event] = [DatasetCached(node=report.node, entry=entry) for key, entry in held.items()
                           if key not in recorded]
    told = {eviction.key: eviction for eviction in report.evicted}
    complete = report.complete
    for key, entry in recorded.items():
        if key in held or (key not in told and not complete):
            continue
        eviction = told.get(key) or CacheEviction(key=key, source=entry.source, bytes=entry.bytes,
                                                  cause="unreadable", evicted_at=report.sent_at)
        events.append(DatasetEvicted(node=report.node, eviction=eviction))
    return Outcome(events=[NewEvent("cache", report.node, event) for event in events])


def mark(node: MonitoredNode, request: MarkComponent, by: str, version: int, jobs: JobLifecycle,
         operators: Sequence[str]) -> Outcome | None:
    """An administrator marks a component faulty, or clears its mark; None when it is so already."""
    current = node.marks.get(request.component)
    if request.faulty and current is not None and current.reason == request.reason:
        return None
    if not request.faulty and current is None:
        return None
    marked = ComponentMarked(node_name=node.name, component=request.component, faulty=request.faulty, by=by,
                             reason=request.reason)
    marks = {k: v for k, v in node.marks.items() if k != request.component}
    if request.faulty:
        marks[request.component] = marked
    return node_changes(node.name, version, [marked, *health_events(node, marks)], was_healthy=not node.problems,
                        jobs=jobs, operators=operators)


def lost_event(node: MonitoredNode, now: float, wall_now: datetime) -> NodeLost:
    silent = now - node.last_seen
    return NodeLost(node_name=node.info.name, last_seen=wall_now - timedelta(seconds=silent),
                    reason=f"no heartbeat for {silent:.0f}s")


def lost(node: MonitoredNode, version: int, now: float, wall_now: datetime, jobs: JobLifecycle,
         operators: Sequence[str], *, released: str | None = None) -> Outcome:
    """The patrol found the node silent past its time (`now` monotonic, `wall_now` the same instant in UTC).
    `released`: why the autoscaler released its instance while a job ran there (a spot interruption): lost,
    so the job is resumed or failed as on any lost node, then retired, for that machine never comes back."""
    events: list[NodeEvent] = [lost_event(node, now, wall_now)]
    if released is not None:
        events.append(NodeRetired(node_name=node.name, reason=f"released by the autoscaler: {released}"))
    return node_changes(node.name, version, events, was_healthy=not node.problems, jobs=jobs, operators=operators)


# --- the scheduler's jobs (M1, M7, J15) --------------------------------------------------------------


def retention_seconds(job: JobRecord, settings: AdminSettings) -> int:
    own = job.spec.debug_terminal.retention if job.spec.debug_terminal else None
    try:
        return parse_duration(own or settings.debug_retention)
    except ValueError:  # validated where it was written; this is a last resort
        return parse_duration(AdminSettings().debug_retention)


def kept_event(job: JobRecord, ended_at: datetime, settings: AdminSettings) -> DebugEnvironmentKept | None:
    """What to record when a debug-terminal job fails or expires (nothing if it never ran)."""
    if not job.debug_terminal or not job.placement:
        return None
    until = ended_at + timedelta(seconds=retention_seconds(job, settings))
    return DebugEnvironmentKept(job_id=job.job_id, attempt=job.attempt, nodes=job.nodes, until=until)


def reaction(envelope: EventEnvelope, job: JobRecord | None, settings: AdminSettings,
             operators: Sequence[str]) -> Outcome:
    """The answer to a new scheduler event, `job` as folded with it (pre-checks are `precheck_result`).

    A job being moved raises an alert. A debug-terminal job that ends well keeps nothing: its workspaces
    are released at once; one that fails or expires keeps its last placement's environment, and the
    workspaces of earlier attempts on other nodes are released. A checkpoint-resume job that fails
    raises an alert.
    """
    event = envelope.event
    if job is None:
        return Outcome()
    if isinstance(event, JobResuming):
        return Outcome(alerts=[alerts.job_resuming(job, event, settings, operators)])
    if isinstance(event, JobSucceeded | JobStopped):
        return Outcome(releases=_releases(job.job_id, job.nodes_used) if job.debug_terminal else [])
    if not isinstance(event, JobFailed | JobExpired):
        return Outcome()
    kept = kept_event(job, envelope.recorded_at, settings)
    outcome = Outcome(events=[NewEvent("job", job.job_id, kept)] if kept else [])
    if isinstance(event, JobFailed) and job.checkpoint_resume:
        outcome.alerts.append(alerts.checkpoint_job_failed(job, event, settings, operators))
    if job.debug_terminal:
        outcome.releases = _releases(job.job_id, [n for n in job.nodes_used if n not in job.nodes])
    return outcome


def _releases(job_id: str, nodes: Iterable[str]) -> list[Release]:
    wanted = list(nodes)
    return [Release(job_id, wanted)] if wanted else []


def precheck_result(event: JobPrechecking, checks: Sequence[NodeCheck], job: JobRecord | None,
                    operators: Sequence[str]) -> Outcome:
    """The pre-check of `event`'s placement is done: it passed when every node did; a failure raises an alert."""
    passed = bool(checks) and all(c.passed for c in checks)
    result = PrecheckCompleted(job_id=event.job_id, attempt=event.attempt, passed=passed, nodes=list(checks))
    raised = [] if passed else [alerts.precheck_failed(job, event.job_id, event.attempt, checks, operators)]
    return Outcome(events=[NewEvent("job", event.job_id, result)], alerts=raised)


def performance(incident: Incident, recorded: int, job: JobRecord | None, operators: Sequence[str]) -> Outcome:
    """A slow rank's incident (M6), with its alert; nothing when it is among the `recorded` ones (a restart)."""
    if recorded >= incident.number:
        return Outcome()
    rule = incident.rule
    event = PerformanceDegraded(job_id=incident.job_id, attempt=incident.attempt, node=incident.node,
                                rank=incident.rank, ratio=round(incident.ratio, 6), threshold=rule.threshold,
                                direction=rule.direction, window=rule.window, action=rule.action)
    return Outcome(events=[NewEvent("job", incident.job_id, event)],
                   alerts=[alerts.performance(job, incident, operators)])


def released(kept: KeptEnvironment) -> Outcome:
    """Every agent removed the kept environment (J15)."""
    if kept.released:
        return Outcome()
    return Outcome(events=[NewEvent("job", kept.job_id, DebugEnvironmentReleased(job_id=kept.job_id,
                                                                                 attempt=kept.attempt))])


def mailed(alert: AlertRaised, unmailed: Mapping[str, object]) -> Outcome:
    """The alert's mail went out (M7); nothing if it was recorded mailed already."""
    if alert.alert_id not in unmailed:
        return Outcome()
    return Outcome(events=[NewEvent("alert", alert.alert_id,
                                    AlertMailed(alert_id=alert.alert_id, recipients=alert.recipients))])


# --- every service's set-aside upstream messages -------------------------------------------------------


# A type's provisioning failures in a row that raise an alert: the third, then every tenth.
FAILING_AFTER = 3
FAILING_EVERY = 10


def autoscaler_event(envelope: EventEnvelope, known: Mapping[str, MonitoredNode], jobs: JobLifecycle,
                     operators: Sequence[str]) -> Outcome:
    """The monitor's answer to the autoscaler's events: a released instance's node retired; an alert for an
    instance that never joined, and for a type that keeps failing to start."""
    event = envelope.event
    if isinstance(event, ProvisionFailed):
        failing = event.failures == FAILING_AFTER or (event.failures > FAILING_AFTER
                                                      and event.failures % FAILING_EVERY == 0)
        return Outcome(alerts=[alerts.provisioning_failing(event, operators)] if failing else [])
    outcome = retired(envelope, known, jobs)
    if isinstance(event, InstanceReleased) and event.cause == "boot-timeout":
        outcome.alerts.append(alerts.instance_boot_timeout(event, operators))
    return outcome


def retired(envelope: EventEnvelope, known: Mapping[str, MonitoredNode], jobs: JobLifecycle) -> Outcome:
    """A node whose instance the autoscaler released is gone on purpose: retired, never counted lost. One a job
    still runs on (its instance vanished under it) is left to the patrol, which counts it lost so that the
    job is resumed or failed as on any lost node."""
    event = envelope.event
    node = known.get(event.instance) if isinstance(event, InstanceReleased) else None
    if not isinstance(event, InstanceReleased) or node is None or (jobs.running_on(node.name) and not node.lost):
        return Outcome()
    return Outcome(events=[NewEvent("node", event.instance, NodeRetired(
        node_name=event.instance, reason=f"released by the autoscaler: {event.reason}"))])


def set_aside(envelope: EventEnvelope, operators: Sequence[str]) -> Outcome:
    """One alert per message a service set aside (its UpstreamMessageSetAside records)."""
    if not isinstance(envelope.event, UpstreamMessageSetAside):
        return Outcome()
    return Outcome(alerts=[alerts.message_set_aside(envelope.service, envelope.event, operators)])


def cache_policy(settings: AdminSettings) -> CachePolicy:
    """D1, D2: how every node keeps its dataset cache, from the administrator's settings."""
    return CachePolicy(retention_seconds=parse_duration(settings.cache_retention),
                       high_percent=settings.cache_high_percent, low_percent=settings.cache_low_percent,
                       disk_high_percent=settings.disk_high_percent, disk_low_percent=settings.disk_low_percent)
