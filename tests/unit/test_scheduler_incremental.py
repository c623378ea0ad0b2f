"""What the scheduler's state keeps up to date as events are folded (the queue, the jobs holding resources, what
is used on each node, how the decision logic sees each job) always equals what working it out from every job
gives, whatever the events; and so a cycle decides on it exactly as on inputs made from scratch. An event that
leaves the state's revision as it was leaves the decision as it was."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.cluster import ClusterConfig, Flavor, NodeInfo, Resources
from libs.contracts.datacache import CacheEntry, StagedDataset
from libs.contracts.events import (
    DatasetCached,
    EventEnvelope,
    JobAdmitted,
    JobDurationChanged,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobPredicted,
    JobPriorityChanged,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    NodeLost,
    NodeProcessStarted,
    NodeRecovered,
    NodeRegistered,
    NodeRetired,
    Placement,
)
from libs.contracts.jobspec import CheckpointResume, DatasetRef, Elastic, JobSpec
from libs.contracts.scheduling import Prediction
from libs.placement import NodeCapacity, QueuedJob, RunningJob, Served, schedule
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.planning.decision_inputs import (
    RECHECK_AFTER,
    node_capacity,
    queued_job,
    running_jobs,
    running_jobs_changed,
)
from services.scheduler.rules import cycle
from tests.support.placement import NOW
from tests.support.strategies import SETTINGS

FLAVORS = [Flavor(name="half", cpus=0.5, memory_mib=512), Flavor(name="small", cpus=1, memory_mib=1024),
           Flavor(name="big", cpus=3, memory_mib=4096)]
CLUSTER = ClusterConfig(flavors=FLAVORS)
NODES = ["n0", "n1", "n2", "n3"]
DATASET = "datasets/imgs/v1"


class Log:
    def __init__(self) -> None:
        self.state = SchedulerState(CLUSTER)
        self.position = 0
        self.jobs: list[str] = []

    def at(self) -> Any:
        return NOW + timedelta(seconds=30 * self.position)

    def apply(self, event: Any, service: str = "scheduler") -> None:
        self.position += 1
        self.state.apply(EventEnvelope(event_id=f"e{self.position}", service=service, aggregate_type="t",
                                       aggregate_id=getattr(event, "job_id", "x"), version=self.position,
                                       position=self.position, recorded_at=self.at(), event=event))


def spec(data: st.DataObject) -> JobSpec:
    nodes = data.draw(st.integers(1, 3))
    flavors = data.draw(st.lists(st.sampled_from([f.name for f in FLAVORS]), min_size=1, max_size=2, unique=True))
    extra: dict[str, Any] = {}
    if data.draw(st.booleans()):
        extra["checkpoint_resume"] = CheckpointResume(elastic=Elastic(min_nodes=1) if nodes > 1 else None)
    if data.draw(st.integers(0, 4)) == 0:
        extra["data_preparation"] = True
        extra["datasets"] = [DatasetRef(name="imgs", source="favorite", version="v1")]
    return JobSpec(name="j", mode="pytorch", nodes=nodes, flavors=flavors,
                   priority=data.draw(st.sampled_from(["normal", "urgent", "very-urgent"])),
                   duration=data.draw(st.sampled_from([None, "5m", "1h"])), command="python3 t.py", **extra)


def placement(data: st.DataObject, job: Job) -> tuple[str, list[Placement]]:
    flavor = data.draw(st.sampled_from([*job.spec.flavors, "unknown"]))
    nodes = data.draw(st.lists(st.sampled_from([*NODES, "gone"]), min_size=1, max_size=job.spec.nodes))
    return flavor, [Placement(rank=r, node=n, address=n, slots=1) for r, n in enumerate(nodes)]


def step(log: Log, data: st.DataObject) -> None:
    """One event of any kind, about a job of any status (not all of them make sense: the fold takes them all)."""
    kind = data.draw(st.sampled_from(["submit", "submit", "admit", "admit", "precheck", "precheck-failed",
                                      "rescale", "resume", "requeue", "restart", "priority", "duration",
                                      "expiring", "stop-requested", "end", "started", "launch-failed",
                                      "predicted", "node", "cached"]))
    if kind == "node":
        name = data.draw(st.sampled_from(NODES))
        change = data.draw(st.sampled_from(["register", "lost", "recovered", "retired"]))
        if change == "register":
            log.apply(NodeRegistered(node=NodeInfo(name=name, address=name, cpus=data.draw(st.sampled_from([2, 4])),
                                                   memory_mib=8192)), "monitor")
        elif change == "lost":
            log.apply(NodeLost(node_name=name, last_seen=log.at(), reason="silent"), "monitor")
        elif change == "recovered":
            log.apply(NodeRecovered(node_name=name), "monitor")
        else:
            log.apply(NodeRetired(node_name=name, reason="gone"), "monitor")
        return
    if kind == "cached":
        entry = CacheEntry(key=data.draw(st.sampled_from(["a", "b"])) * 24, source=DATASET,
                           bytes=data.draw(st.integers(1, 9)), files=1, staged_at=log.at(), last_used=log.at())
        log.apply(DatasetCached(node=data.draw(st.sampled_from(NODES)), entry=entry), "monitor")
        return
    if kind == "submit" or not log.jobs:
        job_id = f"job-{len(log.jobs):012x}"
        log.jobs.append(job_id)
        log.apply(JobSubmitted(job_id=job_id, spec=spec(data), creator="u"))
        return
    job = log.state.jobs[data.draw(st.sampled_from(log.jobs))]
    job_id, attempt = job.job_id, job.attempt
    if kind == "admit":
        flavor, placed = placement(data, job)
        log.apply(JobAdmitted(job_id=job_id, attempt=attempt + 1, flavor=flavor, placement=placed))
    elif kind == "precheck":
        flavor, placed = placement(data, job)
        log.apply(JobPrechecking(job_id=job_id, attempt=attempt + 1, flavor=flavor, placement=placed))
    elif kind == "precheck-failed":
        checked = job.precheck.attempt if job.precheck else attempt
        log.apply(JobPrecheckFailed(job_id=job_id, attempt=checked, reason="bad", nodes=[data.draw(
            st.sampled_from(NODES))]))
    elif kind == "rescale":
        flavor, placed = placement(data, job)
        log.apply(JobRescaling(job_id=job_id, attempt=attempt, flavor=flavor, placement=placed, reason="grows"))
    elif kind == "resume":
        log.apply(JobResuming(job_id=job_id, attempt=attempt, reason="fault",
                              exclude_nodes=data.draw(st.lists(st.sampled_from(NODES), max_size=1))))
    elif kind == "requeue":
        log.apply(JobRequeued(job_id=job_id, attempt=attempt, reason="moved"))
    elif kind == "restart":
        log.apply(JobRestarting(job_id=job_id, attempt=attempt, restarts=1, reason="failed"))
    elif kind == "priority":
        log.apply(JobPriorityChanged(job_id=job_id, priority=data.draw(st.sampled_from(["normal", "urgent"])),
                                     by="u"))
    elif kind == "duration":
        log.apply(JobDurationChanged(job_id=job_id, duration=data.draw(st.sampled_from([None, "1m", "2h"])), by="u"))
    elif kind == "expiring":
        log.apply(JobExpiring(job_id=job_id, attempt=attempt, limit_seconds=60))
    elif kind == "stop-requested":
        log.apply(JobStopRequested(job_id=job_id, by="u"))
    elif kind == "end":
        log.apply(data.draw(st.sampled_from([JobSucceeded(job_id=job_id), JobFailed(job_id=job_id, reason="x"),
                                             JobStopped(job_id=job_id, by="u"),
                                             JobExpired(job_id=job_id, reason="limit")])))
    elif kind == "started":
        staged = [StagedDataset(source=DATASET, key="a" * 24, bytes=1, files=1, hit=False, seconds=42.0)] \
            if data.draw(st.booleans()) else []
        log.apply(NodeProcessStarted(job_id=job_id, attempt=attempt, rank=0, node="n0", pid=7, staged=staged),
                  "launcher")
    elif kind == "launch-failed":
        log.apply(LaunchFailed(job_id=job_id, attempt=attempt, reason="exit 1", exit_code=1), "launcher")
    else:
        log.apply(JobPredicted(job_id=job_id, prediction=Prediction(starts_now=False, reason="waits",
                                                                    predicted_at=log.at())))


# --- the same, worked out from every job ----------------------------------------------------------------------


def queue_from_scratch(state: SchedulerState) -> list[Job]:
    return sorted((j for j in state.active.values() if j.status == "queued" and j.precheck is None),
                  key=lambda j: (j.rank, j.queue_order))


def holding_from_scratch(state: SchedulerState) -> list[Job]:
    return [j for j in state.active.values() if j.status == "running" or j.prechecking]


def used_from_scratch(state: SchedulerState) -> dict[str, Resources]:
    used: dict[str, Resources] = {name: Resources() for name in state.nodes}
    for job in holding_from_scratch(state):
        for node, held in state.holdings(job).items():
            used[node] = used.get(node, Resources()) + held
    return used


def running_from_scratch(state: SchedulerState, now: Any) -> list[RunningJob]:
    running: list[RunningJob] = []
    for job in holding_from_scratch(state):
        held = state.placements(job)
        flavor = CLUSTER.flavor(held[0][0]) if held else None
        if flavor is None:
            continue
        ends_at = job.ends_at
        if job.prechecking and job.duration_seconds is not None:
            ends_at = now + timedelta(seconds=job.duration_seconds) - job.ran_before
        running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor,
                                  placement=[p for _, placement in held for p in placement], ends_at=ends_at,
                                  can_grow=job.status == "running" and not job.moving,
                                  excluded_nodes=frozenset(job.excluded_nodes)))
    return running


def seconds(duration: str | None) -> int | None:
    return int(duration[:-1]) * {"m": 60, "h": 3600}[duration[-1]] if duration else None


def ends_from_scratch(job: Job) -> Any:
    limit = seconds(job.duration)
    if job.running_since is None or limit is None:
        return None
    return job.running_since + timedelta(seconds=limit) - job.ran_before + timedelta(
        seconds=sum(job.staging_seconds.values()))


def queued_from_scratch(state: SchedulerState, job: Job, now: Any) -> QueuedJob:
    from msgspec.structs import replace

    return QueuedJob(job.job_id, replace(job.spec, priority=job.priority), seconds(job.duration),
                     state.avoided_nodes(job, now, RECHECK_AFTER), prefer=state.data_on_nodes(job.spec))


def nodes_from_scratch(state: SchedulerState) -> list[NodeCapacity]:
    used = used_from_scratch(state)
    return [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
            for name, n in state.nodes.items() if n.schedulable]


@SETTINGS
@given(st.data())
def test_what_the_state_keeps_equals_what_every_job_gives(data: st.DataObject) -> None:
    log = Log()
    given: list[RunningJob] | None = None  # what a cycle was last given of the running jobs
    for _ in range(data.draw(st.integers(1, 60))):
        step(log, data)
        state, now = log.state, log.at() + timedelta(seconds=data.draw(st.sampled_from([0, 90])))
        assert [j.job_id for j in state.queue()] == [j.job_id for j in queue_from_scratch(state)]
        assert [j.job_id for j in state.holding()] == [j.job_id for j in holding_from_scratch(state)]
        assert state.used() == used_from_scratch(state)
        assert node_capacity(state) == nodes_from_scratch(state)
        assert running_jobs(state, now) == running_from_scratch(state, now)
        if data.draw(st.booleans()):  # a cycle runs: it is given the running jobs, and told how they changed
            listed, change = running_jobs_changed(state, now)
            assert listed == running_from_scratch(state, now)
            if change is not None:
                assert given is not None and change.before is given
                assert set(map(id, change.gone)) == set(map(id, given)) - set(map(id, listed))
                assert set(map(id, change.added)) == set(map(id, listed)) - set(map(id, given))
            given = listed
        for job in state.queue():
            made = queued_job(state, job, now)
            assert made == queued_from_scratch(state, job, now)
            assert made.shape == queued_from_scratch(state, job, now).shape
        assert [state.view(j).queue_position for j in state.queue()] == list(range(1, len(state.queue()) + 1))
        for job in state.jobs.values():
            assert job.ends_at == ends_from_scratch(job)
        counted = Counter(job.status for job in state.jobs.values())
        assert {status: n for status, n in state.status_counts().items() if n} == counted


@SETTINGS
@given(st.data())
def test_a_cycle_decides_as_on_inputs_made_from_scratch(data: st.DataObject) -> None:
    log = Log()
    for _ in range(data.draw(st.integers(1, 40))):
        now = log.at() + timedelta(seconds=15)
        before = (log.state.revision, cycle.decide(log.state, now))
        step(log, data)
        state = log.state
        decision = cycle.decide(state, now)
        if state.revision == before[0]:  # the event changed nothing a cycle decides on
            assert decision == before[1]
        nodes = nodes_from_scratch(state)
        served = Served.by(node.info for node in nodes)  # a job no node could take is passed over
        queue = [queued_from_scratch(state, job, now) for job in queue_from_scratch(state)
                 if served.may_serve(job.spec)]
        running = running_from_scratch(state, now)
        expected = schedule(queue, nodes, {f.name: f for f in FLAVORS}, running=running, now=now)
        if decision is None:
            assert not queue and not expected.admissions and not expected.growths
        else:
            assert decision == expected
