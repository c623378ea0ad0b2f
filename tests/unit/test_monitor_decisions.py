"""The monitor's decisions, without NATS or a database: inputs in, events, alerts and releases out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from libs.contracts.cluster import NodeInfo
from libs.contracts.datacache import MAX_CACHE_ENTRIES_REPORTED, CachedImage, CacheEntry, CacheEviction, CacheReport
from libs.contracts.events import (
    DatasetCached,
    DatasetEvicted,
    DebugEnvironmentKept,
    Event,
    EventEnvelope,
    InstanceReleased,
    JobAdmitted,
    JobFailed,
    JobPredicted,
    JobSubmitted,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeLost,
    NodeRecovered,
    NodeRetired,
    NodeUnhealthy,
    Placement,
    ProvisionFailed,
)
from libs.contracts.health import ComponentHealth
from libs.contracts.jobspec import AlgorithmRef, DatasetRef, DebugTerminal, JobSpec, OutputRef
from libs.contracts.operations.cluster import MarkComponent
from libs.contracts.scheduling import Prediction
from libs.jobstatus import JobLifecycle
from services.monitor import caches
from services.monitor import rules as decisions
from services.monitor.state import MonitoredNode, MonitorState

NOW = datetime(2025, 1, 1, tzinfo=UTC)
SPEC = JobSpec(name="debug-me", flavors=["cpu-2"], algorithm=AlgorithmRef(name="a"), command="python3 t.py",
               output=OutputRef(name="o"), debug_terminal=DebugTerminal(retention="1h"))


INFO = NodeInfo(name="node-a", address="127.0.0.1", cpus=8, memory_mib=16384)


def envelope(job_id: str, version: int, event: Event) -> EventEnvelope:
    return EventEnvelope(event_id=f"e{version}", service="scheduler", aggregate_type="job", aggregate_id=job_id,
                         version=version, position=version, recorded_at=NOW, event=event)


def placed(*nodes: str) -> list[Placement]:
    return [Placement(rank=i, node=n, address="127.0.0.1", slots=1) for i, n in enumerate(nodes)]


def test_a_lost_node_heartbeating_a_fault_recovers_and_turns_unhealthy_with_an_alert_named_by_its_version() -> None:
    jobs = JobLifecycle()
    beating = MonitoredNode(info=INFO, lost=True,
                            probed=[ComponentHealth(kind="board", name="0", healthy=False, detail="hot")])
    outcome = decisions.heartbeat(beating, 4, jobs, ["ops@example.com"])
    assert [type(c.event) for c in outcome.events] == [NodeRecovered, NodeUnhealthy]
    assert [a.alert_id for a in outcome.alerts] == ["node-unhealthy-node-a-6"]
    assert [c.aggregate_type for c in outcome.changes] == ["node", "node", "alert"]


def test_the_patrol_records_a_silent_node_lost_with_an_alert() -> None:
    silent = MonitoredNode(info=INFO, last_seen=100.0)
    outcome = decisions.lost(silent, 2, 130.0, NOW, JobLifecycle(), [])
    [change] = outcome.events
    assert isinstance(change.event, NodeLost)
    assert change.event.last_seen == NOW - timedelta(seconds=30)
    assert [a.alert_id for a in outcome.alerts] == ["node-lost-node-a-3"]


def test_a_mark_that_changes_nothing_records_nothing() -> None:
    clean = MonitoredNode(info=INFO, probed=[])
    assert decisions.mark(clean, MarkComponent(node="node-a", component="board:0", faulty=False), "root", 1,
                          JobLifecycle(), []) is None


def test_a_failed_debug_job_keeps_its_last_placement_and_releases_the_nodes_of_earlier_attempts() -> None:
    jobs, job_id = JobLifecycle(), "job-0123456789ab"
    jobs.apply(envelope(job_id, 1, JobSubmitted(job_id=job_id, spec=SPEC, creator="alice")))
    jobs.apply(envelope(job_id, 2, JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-2", placement=placed("n1"))))
    jobs.apply(envelope(job_id, 3, JobAdmitted(job_id=job_id, attempt=2, flavor="cpu-2", placement=placed("n2"))))
    failed = envelope(job_id, 4, JobFailed(job_id=job_id, reason="rank 0 exited with code 1", exit_code=1))
    outcome = decisions.reaction(failed, jobs.apply(failed), jobs.settings, [])
    [kept] = [c.event for c in outcome.events]
    assert isinstance(kept, DebugEnvironmentKept)
    assert (kept.attempt, kept.nodes, kept.until) == (2, ["n2"], NOW + timedelta(hours=1))
    assert outcome.alerts == []
    assert [(r.job_id, r.nodes) for r in outcome.releases] == [(job_id, ["n1"])]


def test_a_node_whose_instance_the_autoscaler_released_is_retired_without_an_alert_and_not_patrolled() -> None:
    released = EventEnvelope(event_id="a1", service="autoscaler", aggregate_type="instance", aggregate_id="node-a",
                             version=3, position=9, recorded_at=NOW,
                             event=InstanceReleased(instance="node-a", reason="idle for 60s"))
    state = MonitorState(nodes={"node-a": MonitoredNode(info=INFO, last_seen=100.0)})
    outcome = decisions.retired(released, state.nodes, JobLifecycle())
    [change] = outcome.events
    assert change.event == NodeRetired(node_name="node-a", reason="released by the autoscaler: idle for 60s")
    assert outcome.alerts == []
    state.apply(EventEnvelope(event_id="m1", service="monitor", aggregate_type="node", aggregate_id="node-a",
                              version=2, position=10, recorded_at=NOW, event=change.event), now=200.0)
    assert state.overdue(now=1000.0, lost_after=10.0) == []
    assert decisions.retired(released, state.nodes, JobLifecycle()).events == []  # a node it does not know


def test_a_released_instance_a_job_still_runs_on_is_left_to_be_counted_lost() -> None:
    released = EventEnvelope(event_id="a1", service="autoscaler", aggregate_type="instance", aggregate_id="node-a",
                             version=3, position=9, recorded_at=NOW,
                             event=InstanceReleased(instance="node-a", reason="aws-ec2 no longer runs it"))
    jobs = JobLifecycle()
    jobs.apply(envelope("job-1", 1, JobSubmitted(job_id="job-1", spec=SPEC, creator="alice")))
    jobs.apply(envelope("job-1", 2, JobAdmitted(job_id="job-1", attempt=1, flavor="cpu-2", placement=placed("node-a"))))
    assert decisions.retired(released, {"node-a": MonitoredNode(info=INFO)}, jobs).events == []
    assert len(decisions.retired(released, {"node-a": MonitoredNode(info=INFO, lost=True)}, jobs).events) == 1


def test_a_vanished_instance_a_job_ran_on_is_counted_lost_then_retired_by_the_patrol() -> None:
    """A spot interruption: the autoscaler released the instance while a job ran there. The patrol counts the
    node lost (the job resumes for that reason, and people are told) and retires it in the same append."""
    state = MonitorState(nodes={"node-a": MonitoredNode(info=INFO, last_seen=100.0)})
    state.apply_autoscaler(EventEnvelope(event_id="a1", service="autoscaler", aggregate_type="instance",
                                         aggregate_id="node-a", version=3, position=9, recorded_at=NOW,
                                         event=InstanceReleased(instance="node-a", reason="aws-ec2 no longer runs it",
                                                                cause="gone")))
    [silent] = state.overdue(now=130.0, lost_after=10.0)
    outcome = decisions.lost(silent, 2, 130.0, NOW, JobLifecycle(), [], released=state.released.get("node-a"))
    assert [type(c.event) for c in outcome.events] == [NodeLost, NodeRetired]
    assert [a.alert_id for a in outcome.alerts] == ["node-lost-node-a-3"]
    for version, change in enumerate(outcome.events, start=3):
        state.apply(EventEnvelope(event_id=f"m{version}", service="monitor", aggregate_type="node",
                                  aggregate_id="node-a", version=version, position=10 + version, recorded_at=NOW,
                                  event=change.event), now=130.0)
    assert state.nodes == {} and state.released == {}
    # A node whose instance was not released is only counted lost.
    assert [type(c.event) for c in decisions.lost(silent, 2, 130.0, NOW, JobLifecycle(), []).events] == [NodeLost]


def test_an_instance_that_never_joined_and_a_type_that_keeps_failing_raise_alerts_once() -> None:
    timed_out = EventEnvelope(event_id="a1", service="autoscaler", aggregate_type="instance", aggregate_id="gpu-1",
                              version=3, position=9, recorded_at=NOW,
                              event=InstanceReleased(instance="gpu-1", reason="its agent did not register within 600s",
                                                     cause="boot-timeout"))
    [alert] = decisions.autoscaler_event(timed_out, {}, JobLifecycle(), ["ops@example.com"]).alerts
    assert (alert.kind, alert.alert_id, alert.node, alert.recipients) == (
        "instance-boot-timeout", "instance-boot-timeout-gpu-1", "gpu-1", ["ops@example.com"])

    def failed(failures: int) -> EventEnvelope:
        return EventEnvelope(event_id=f"f{failures}", service="autoscaler", aggregate_type="instance",
                             aggregate_id=f"gpu-{failures}", version=1, position=failures, recorded_at=NOW,
                             event=ProvisionFailed(instance=f"gpu-{failures}", instance_type="gpu", capacity=True,
                                                   reason="InsufficientInstanceCapacity", failures=failures))

    raised = [n for n in range(1, 31) if decisions.autoscaler_event(failed(n), {}, JobLifecycle(), []).alerts]
    assert raised == [3, 10, 20, 30]
    [alert] = decisions.autoscaler_event(failed(3), {}, JobLifecycle(), []).alerts
    assert alert.kind == "provisioning-failing" and "no capacity" in alert.message


def test_a_cache_report_records_new_entries_and_the_ones_gone_with_their_cause() -> None:
    def entry(key: str, source: str) -> CacheEntry:
        return CacheEntry(key=key, source=source, bytes=10, files=1, staged_at=NOW, last_used=NOW)

    kept, evicted, vanished, new = (entry(f"{i:024x}", f"datasets/d{i}") for i in range(4))
    report = CacheReport(node="node-a", sent_at=NOW, entries=[kept, new], evicted=[CacheEviction(
        key=evicted.key, source=evicted.source, bytes=10, cause="watermark", evicted_at=NOW)])
    outcome = decisions.cache_report(report, {e.key: e for e in (kept, evicted, vanished)})
    assert [(c.aggregate_type, c.aggregate_id) for c in outcome.events] == [("cache", "node-a")] * 3
    events = [c.event for c in outcome.events]
    assert [e.entry.key for e in events if isinstance(e, DatasetCached)] == [new.key]
    assert sorted((e.eviction.key, e.eviction.cause) for e in events if isinstance(e, DatasetEvicted)) == [
        (evicted.key, "watermark"), (vanished.key, "unreadable")]
    # The same report again changes nothing: a redelivery records nothing twice.
    state = MonitorState()
    for version, change in enumerate(outcome.events, start=1):
        state.apply(EventEnvelope(event_id=f"c{version}", service="monitor", aggregate_type="cache",
                                  aggregate_id="node-a", version=version, position=version, recorded_at=NOW,
                                  event=change.event), now=0.0)
    state.cached["node-a"].update({kept.key: kept})
    assert decisions.cache_report(report, state.cached["node-a"]).events == []


def test_a_cut_short_cache_report_records_no_eviction_of_the_entries_it_leaves_out() -> None:
    """A cache of more entries than one report carries sends its most recently used ones: an entry recorded
    before and left out of such a report is no eviction; one the report tells evicted is, and one that vanished
    is recorded once a whole report comes."""
    entries = [CacheEntry(key=f"{i:024x}", source=f"datasets/d{i}", bytes=10, files=1, staged_at=NOW, last_used=NOW)
               for i in range(MAX_CACHE_ENTRIES_REPORTED + 2)]
    listed, (unlisted, evicted) = entries[:MAX_CACHE_ENTRIES_REPORTED], entries[MAX_CACHE_ENTRIES_REPORTED:]
    recorded = {e.key: e for e in entries}
    told = CacheEviction(key=evicted.key, source=evicted.source, bytes=10, cause="retention", evicted_at=NOW)
    cut = CacheReport(node="node-a", sent_at=NOW, entries=listed, evicted=[told], total_entries=len(entries) - 1)
    assert not cut.complete
    events = [c.event for c in decisions.cache_report(cut, recorded).events]
    assert [(e.eviction.key, e.eviction.cause) for e in events if isinstance(e, DatasetEvicted)] == [
        (evicted.key, "retention")]
    assert not any(isinstance(e, DatasetCached) for e in events)
    # An older agent's report says nothing of being cut: one that fills the bound may have been.
    older = CacheReport(node="node-a", sent_at=NOW, entries=listed)
    assert decisions.cache_report(older, recorded).events == []
    # A whole report: what it does not list is gone.
    whole = CacheReport(node="node-a", sent_at=NOW, entries=listed[1:], total_entries=len(listed) - 1)
    events = [c.event for c in decisions.cache_report(whole, recorded).events]
    assert sorted((e.eviction.key, e.eviction.cause) for e in events if isinstance(e, DatasetEvicted)) == sorted(
        (e.key, "unreadable") for e in (listed[0], unlisted, evicted))


def test_the_cache_listing_shows_each_nodes_images_and_whether_its_entries_are_cut_short() -> None:
    entry = CacheEntry(key="0" * 24, source="datasets/d", bytes=10, files=1, staged_at=NOW, last_used=NOW)
    image = CachedImage(key="a" * 24, digest="sha256:" + "a" * 64, ref="team/torch:2.13", format="rootfs", bytes=10,
                        unpacked_at=NOW, last_used=NOW)
    reports = {"node-a": CacheReport(node="node-a", sent_at=NOW, entries=[entry], total_entries=9000, images=[image]),
               "node-b": CacheReport(node="node-b", sent_at=NOW, entries=[entry])}
    nodes = {name: MonitoredNode(info=NodeInfo(name=name, address="10.0.0.1", cpus=8, memory_mib=1024),
                                 last_seen=0.0) for name in reports}
    shown = caches.listing(reports, nodes).nodes
    assert [(n.node, n.complete, n.total_entries, n.images) for n in shown] == [
        ("node-a", False, 9000, [image]), ("node-b", True, None, [])]


def test_a_disk_under_pressure_is_recorded_once_and_relieved_once() -> None:
    node = MonitoredNode(info=INFO, probed=[])
    reason = "local disk 93% full (above 90%); takes work again at or below 85%"
    [pressure] = decisions.heartbeat(node, 1, JobLifecycle(), [], disk_pressure=reason).events
    assert pressure.event == NodeDiskPressure(node_name="node-a", reason=reason)
    node.disk_pressure = reason
    assert decisions.heartbeat(node, 2, JobLifecycle(), [], disk_pressure=reason).events == []
    [relieved] = decisions.heartbeat(node, 2, JobLifecycle(), []).events
    assert relieved.event == NodeDiskRelieved(node_name="node-a")
    assert decisions.heartbeat(node, 2, JobLifecycle(), [], disk_pressure=reason).alerts == []  # no alert: no fault


def test_a_job_that_waits_has_its_staged_datasets_copied_to_its_predicted_nodes_only() -> None:
    prep = JobSpec(name="prep", flavors=["cpu-2"], algorithm=AlgorithmRef(name="a"), command="python3 t.py",
                   output=OutputRef(name="o"), data_preparation=True,
                   datasets=[DatasetRef(name="imgs", source="favorite", version="v1"), DatasetRef(name="labels")])

    def predicted(starts_now: bool, nodes: list[str]) -> JobPredicted:
        return JobPredicted(job_id="job-1", prediction=Prediction(starts_now=starts_now, nodes=nodes, predicted_at=NOW))

    assert caches.warm_ups(predicted(False, ["n1", "n2", "n1"]), prep) == [
        ("n1", "datasets/imgs/v1"), ("n1", "datasets/labels"), ("n2", "datasets/imgs/v1"), ("n2", "datasets/labels")]
    assert caches.warm_ups(predicted(True, ["n1"]), prep) == []  # it starts now: its own staging copies them
    assert caches.warm_ups(predicted(False, ["n1"]), SPEC) == []  # no data preparation
    assert caches.warm_ups(predicted(False, ["n1"]), None) == []
