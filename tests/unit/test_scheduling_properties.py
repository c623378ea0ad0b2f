"""Properties of a scheduling cycle over random clusters and workloads (SPEC S4, S5, S9, S10, X1)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import ClusterConfig, Flavor, Resources
from libs.contracts.events import EventEnvelope, JobAdmitted, JobSubmitted, JobSucceeded, NodeRegistered
from libs.contracts.jobspec import CheckpointResume, Elastic, JobSpec
from services.scheduler.placement import (
    Admission,
    Decision,
    NodeCapacity,
    QueuedJob,
    Reservation,
    RunningJob,
    eligible,
    holdings,
    place_gang,
    role_flavor,
    schedule,
)
from services.scheduler.state import SchedulerState
from tests.unit.test_placement import NOW, info

BOARDS = ["A100", "MLU370"]
SETTINGS = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Scenario:
    nodes: list[NodeCapacity]  # free = total minus what `running` holds
    flavors: dict[str, Flavor]
    running: list[RunningJob]
    queue: list[QueuedJob]


@st.composite
def flavor_sets(draw: st.DrawFn) -> dict[str, Flavor]:
    flavors: dict[str, Flavor] = {}
    for index in range(draw(st.integers(1, 3))):
        accelerators = draw(st.sampled_from([0, 0, 0, 1, 2, 4, 8]))
        flavors[f"f{index}"] = Flavor(
            name=f"f{index}", cpus=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0])),
            memory_mib=draw(st.integers(256, 8192)), accelerators=accelerators,
            board=draw(st.sampled_from([None, *BOARDS])) if accelerators else None)
    return flavors


@st.composite
def job_specs(draw: st.DrawFn, flavor_names: list[str], node_names: list[str]) -> JobSpec:
    names = draw(st.lists(st.sampled_from([*flavor_names, *flavor_names, "unknown"]), min_size=1, max_size=3,
                          unique=True))
    extra: dict[str, Any] = {}
    restriction = draw(st.sampled_from(["none", "none", "none", "pool", "pin", "driver"]))
    if restriction == "pool":
        extra["pool"] = draw(st.sampled_from(["p1", "p2"]))
    elif restriction == "pin" and node_names:
        extra["node_names"] = draw(st.lists(st.sampled_from(node_names), min_size=1, unique=True))
    elif restriction == "driver":
        extra["driver_version"] = draw(st.sampled_from(["1", "2"]))
    nodes = draw(st.sampled_from([1, 1, 2, 3, 4]))
    kind = draw(st.sampled_from(["plain", "plain", "elastic", "tensorflow"]))
    if kind == "elastic":
        resume = CheckpointResume(elastic=Elastic(min_nodes=draw(st.integers(1, nodes))))
        return JobSpec(name="j", mode="pytorch", nodes=nodes, flavors=names, checkpoint_resume=resume, **extra)
    if kind == "tensorflow":
        return JobSpec(name="j", mode="tensorflow", nodes=nodes, parameter_servers=draw(st.integers(0, 2)),
                       flavors=names, **extra)
    return JobSpec(name="j", mode="pytorch", nodes=nodes, flavors=names, **extra)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    flavors = draw(flavor_sets())
    infos = []
    for index in range(draw(st.integers(1, 6))):
        infos.append(info(f"n{index}", cpus=draw(st.sampled_from([2.0, 4.0, 8.0, 16.0])),
                          memory_mib=draw(st.integers(1024, 65536)), gpus=draw(st.sampled_from([0, 4, 8])),
                          board=draw(st.sampled_from(BOARDS)), driver=draw(st.sampled_from(["1", "2"])),
                          pools=draw(st.sampled_from([[], [], ["p1"], ["p1", "p2"]]))))
    names = [i.name for i in infos]
    free = [NodeCapacity(info=i, free=Resources.of_node(i)) for i in infos]
    running: list[RunningJob] = []
    for index in range(draw(st.integers(0, 4))):
        job_spec = draw(job_specs(sorted(flavors), names))
        known = [f for f in job_spec.flavors if f in flavors]
        if not known:
            continue
        flavor = flavors[known[0]]
        count = draw(st.integers(1, job_spec.nodes))  # elastic or not, it may run smaller (shrunken)
        placement = place_gang(job_spec, flavor, free, node_count=count)
        if placement is None:
            continue
        held = holdings(placement, flavor)
        free = [NodeCapacity(info=n.info, free=n.free - held.get(n.info.name, Resources())) for n in free]
        ends = draw(st.sampled_from([None, -60, 300, 600, 1800, 3600]))
        running.append(RunningJob(job_id=f"r{index}", spec=job_spec, flavor=flavor, placement=placement,
                                   ends_at=NOW + timedelta(seconds=ends) if ends is not None else None,
                                   can_grow=draw(st.booleans())))
    queue = [QueuedJob(f"j{index}", draw(job_specs(sorted(flavors), names)),
                       draw(st.sampled_from([None, 60, 300, 900, 3600, 7200])))
             for index in range(draw(st.integers(0, 8)))]
    return Scenario(nodes=free, flavors=flavors, running=running, queue=queue)


def run(scenario: Scenario) -> Decision:
    return schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW)


def excess(amount: Resources, own: Resources) -> Resources:
    return Resources(cpus=max(amount.cpus - own.cpus, 0), memory_mib=max(amount.memory_mib - own.memory_mib, 0),
                     accelerators=max(amount.accelerators - own.accelerators, 0))


@SETTINGS
@given(scenarios())
def test_no_node_is_ever_overcommitted(scenario: Scenario) -> None:
    decision = run(scenario)
    used: dict[str, Resources] = {n.info.name: Resources() for n in scenario.nodes}

    def charge(held: dict[str, Resources]) -> None:
        for name, amount in held.items():
            used[name] = used[name] + amount

    for job in scenario.running:
        charge(holdings(job.placement, job.flavor))
    for admission in decision.admissions:
        charge(holdings(admission.placement, scenario.flavors[admission.flavor]))
    by_id = {job.job_id: job for job in scenario.running}
    for growth in decision.growths:
        job = by_id[growth.job_id]
        own = holdings(job.placement, job.flavor)
        # While a job moves, its old and new nodes are both held.
        charge({name: excess(amount, own.get(name, Resources()))
                for name, amount in holdings(growth.placement, job.flavor).items()})
    for n in scenario.nodes:
        assert used[n.info.name].fits_in(Resources.of_node(n.info)), (n.info.name, used[n.info.name])


@SETTINGS
@given(scenarios())
def test_admissions_place_whole_gangs_on_eligible_nodes(scenario: Scenario) -> None:
    decision = run(scenario)
    specs = {job.job_id: job.spec for job in scenario.queue}
    infos = {n.info.name: n.info for n in scenario.nodes}
    assert len({a.job_id for a in decision.admissions}) == len(decision.admissions)
    for admission in decision.admissions:
        job_spec = specs[admission.job_id]
        flavor = scenario.flavors[admission.flavor]
        assert admission.flavor in job_spec.flavors  # S5
        assert sorted([admission.flavor, *admission.dropped_flavors]) == sorted(job_spec.flavors)
        workers = [p for p in admission.placement if p.role == "worker"]
        servers = [p for p in admission.placement if p.role == "ps"]
        elastic = job_spec.checkpoint_resume.elastic if job_spec.checkpoint_resume else None
        lowest = elastic.min_nodes if elastic else job_spec.nodes
        assert lowest <= len(workers) <= job_spec.nodes  # S4, S10
        assert len(servers) == (job_spec.parameter_servers if job_spec.mode == "tensorflow" else 0)
        assert [p.rank for p in admission.placement] == list(range(len(admission.placement)))
        for placed in admission.placement:
            assert eligible(infos[placed.node], job_spec, role_flavor(placed.role, flavor))  # S9
    running = {job.job_id: job for job in scenario.running}
    for growth in decision.growths:
        job = running[growth.job_id]
        before = sum(1 for p in job.placement if p.role == "worker")
        after = sum(1 for p in growth.placement if p.role == "worker")
        assert before < after <= job.spec.nodes
    assert not set(decision.unplaceable) & {a.job_id for a in decision.admissions}


@SETTINGS
@given(scenarios())
def test_backfilled_jobs_never_move_the_reservation_later(scenario: Scenario) -> None:
    decision = run(scenario)
    if decision.reservation is None:
        return
    durations = {job.job_id: job.duration_seconds for job in scenario.queue}
    specs = {job.job_id: job.spec for job in scenario.queue}

    def next_reservation(started: list[Admission]) -> Reservation | None:
        """The head's reservation in the next cycle, with `started` running until their duration limits."""
        running = list(scenario.running)
        nodes = {n.info.name: n for n in scenario.nodes}
        for admission in started:
            seconds = durations[admission.job_id]
            flavor = scenario.flavors[admission.flavor]
            running.append(RunningJob(job_id=admission.job_id, spec=specs[admission.job_id], flavor=flavor,
                                      placement=admission.placement,
                                      ends_at=NOW + timedelta(seconds=seconds) if seconds is not None else None))
            for name, amount in holdings(admission.placement, flavor).items():
                nodes[name] = NodeCapacity(info=nodes[name].info, free=nodes[name].free - amount)
        left = [j for j in scenario.queue if j.job_id not in {a.job_id for a in started}]
        return schedule(left, list(nodes.values()), scenario.flavors, running=running, now=NOW).reservation

    without = next_reservation([a for a in decision.admissions if not a.backfilled])
    with_backfill = next_reservation(decision.admissions)
    assert without == decision.reservation  # the cycle's reservation counts its in-order admissions
    assert with_backfill is not None and with_backfill.job_id == without.job_id
    if without.start is not None:
        assert with_backfill.start is not None and with_backfill.start <= without.start


@SETTINGS
@given(scenarios())
def test_a_cycle_is_a_function_of_its_inputs(scenario: Scenario) -> None:
    assert run(scenario) == run(scenario)


# --- replaying the events of several cycles ---------------------------------------------------------------


class EventLog:
    def __init__(self) -> None:
        self.envelopes: list[EventEnvelope] = []
        self.versions: dict[str, int] = {}

    def append(self, event: Any, service: str, aggregate_type: str, aggregate_id: str, minute: int) -> None:
        self.versions[aggregate_id] = self.versions.get(aggregate_id, 0) + 1
        self.envelopes.append(EventEnvelope(
            event_id=f"e{len(self.envelopes) + 1}", service=service, aggregate_type=aggregate_type,
            aggregate_id=aggregate_id, version=self.versions[aggregate_id], position=len(self.envelopes) + 1,
            recorded_at=NOW + timedelta(minutes=minute), event=event))


def fold(cluster: ClusterConfig, envelopes: list[EventEnvelope]) -> SchedulerState:
    state = SchedulerState(cluster)
    for envelope in envelopes:
        state.apply(envelope)
    return state


def inputs(state: SchedulerState, flavors: dict[str, Flavor], minute: int) -> tuple[
        list[QueuedJob], list[NodeCapacity], list[RunningJob]]:
    """What the service hands a cycle: the queue, free capacity and running jobs, from the folded state."""
    used: dict[str, Resources] = {}
    running: list[RunningJob] = []
    for job in state.running():
        flavor = flavors[job.flavor or ""]
        for name, amount in holdings(job.placement, flavor).items():
            used[name] = used.get(name, Resources()) + amount
        running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=list(job.placement),
                                  ends_at=None))
    nodes = [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
             for name, n in state.nodes.items()]
    return [QueuedJob(j.job_id, j.spec) for j in state.queue()], nodes, running


@SETTINGS
@given(scenarios(), st.lists(st.integers(0, 3), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_replaying_the_events_rebuilds_the_same_queue_and_placements(
        scenario: Scenario, arrivals: list[int], rng: Any) -> None:
    cluster = ClusterConfig(flavors=list(scenario.flavors.values()))
    log = EventLog()
    for n in scenario.nodes:
        log.append(NodeRegistered(node=n.info), "monitor", "node", n.info.name, 0)
    live = fold(cluster, log.envelopes)
    pending = list(scenario.queue)
    for minute, count in enumerate(arrivals, start=1):
        for arriving in pending[:count]:
            log.append(JobSubmitted(job_id=arriving.job_id, spec=arriving.spec, creator="u"), "scheduler", "job",
                       arriving.job_id, minute)
        pending = pending[count:]
        live = fold(cluster, log.envelopes)
        for job in live.running():
            if rng.random() < 0.5:
                log.append(JobSucceeded(job_id=job.job_id), "scheduler", "job", job.job_id, minute)
        live = fold(cluster, log.envelopes)
        queue, nodes, running = inputs(live, scenario.flavors, minute)
        decision = schedule(queue, nodes, scenario.flavors, running=running, now=NOW + timedelta(minutes=minute))
        for admission in decision.admissions:
            log.append(JobAdmitted(job_id=admission.job_id, attempt=1, flavor=admission.flavor,
                                   placement=admission.placement, dropped_flavors=admission.dropped_flavors,
                                   backfilled=admission.backfilled), "scheduler", "job", admission.job_id, minute)
    first, second = fold(cluster, log.envelopes), fold(cluster, log.envelopes)
    assert [j.job_id for j in first.queue()] == [j.job_id for j in second.queue()]
    assert {j.job_id: j.placement for j in first.running()} == {j.job_id: j.placement for j in second.running()}
    assert {i: first.jobs[i].placement for i in first.jobs} == {i: second.jobs[i].placement for i in second.jobs}
