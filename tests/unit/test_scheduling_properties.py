"""Properties of a scheduling cycle over random clusters and workloads (SPEC S4, S5, S9, S10, X1)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.cluster import ClusterConfig, Flavor, Resources
from libs.contracts.events import EventEnvelope, JobAdmitted, JobSubmitted, JobSucceeded, NodeRegistered
from libs.placement import (
    Admission,
    Decision,
    NodeCapacity,
    QueuedJob,
    Reservation,
    RunningJob,
    eligible,
    holdings,
    role_flavor,
    schedule,
)
from services.scheduler.domain.state import SchedulerState
from tests.support.placement import NOW
from tests.support.strategies import SETTINGS, Scenario, scenarios


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
