"""The scheduler in virtual time (SPEC S6): a simulation from one state must start every job exactly when
the scheduler does, when the jobs run to their limits and nothing else happens.

"The scheduler" here is its own state fold (`SchedulerState`) and cycle rules (`cycle.decide`,
`cycle.admissions`), driven by events at virtual instants as the service records them: every job submitted,
a cycle at each instant something ends, each job's end recorded at its limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, NodeInfo
from libs.contracts.events import JobSubmitted, NodeRegistered
from libs.contracts.jobspec import JobSpec
from libs.placement import CYCLE_DEPTH, NodeCapacity
from services.scheduler.planning.decision_inputs import cluster_flavors, node_capacity, queued_jobs, running_jobs
from services.scheduler.planning.simulation import Arrival, Simulation, simulate
from tests.support.placement import CPU4, NOW, busy, info, node, queued, run_on
from tests.support.strategies import BOARDS, SETTINGS, flavor_sets, job_specs
from tests.support.virtual_scheduler import VirtualScheduler

DURATIONS = [None, "5m", "10m", "30m", "1h", "2h"]


@dataclass
class Workload:
    flavors: dict[str, Flavor]
    nodes: list[NodeInfo]
    jobs: list[JobSpec]
    snapshot_after: int  # the instant, counted from the first, at which the simulation starts


@st.composite
def busy_workloads(draw: st.DrawFn) -> Workload:
    """Few CPU nodes and many jobs of a few sizes: a head waits and the jobs behind it backfill or not."""
    flavors = {f"c{cpus}": Flavor(name=f"c{cpus}", cpus=cpus, memory_mib=1024) for cpus in (1, 2, 4)}
    nodes = [info(f"n{index}", cpus=4, memory_mib=8192) for index in range(draw(st.integers(1, 3)))]
    jobs = [JobSpec(name="j", mode="pytorch", nodes=draw(st.sampled_from([1, 1, 2])),
                    flavors=draw(st.lists(st.sampled_from(sorted(flavors)), min_size=1, max_size=2, unique=True)),
                    priority=draw(st.sampled_from(["urgent", "normal", "normal"])),
                    duration=draw(st.sampled_from(["5m", "10m", "15m", "30m", "1h"])))
            for _ in range(draw(st.integers(2, 20)))]
    return Workload(flavors, nodes, jobs, draw(st.integers(0, 6)))


@st.composite
def varied_workloads(draw: st.DrawFn) -> Workload:
    """Random flavors, boards, pools, pinned nodes and parameter servers."""
    flavors = draw(flavor_sets())
    nodes = [info(f"n{index}", cpus=draw(st.sampled_from([2.0, 4.0, 8.0, 16.0])),
                  memory_mib=draw(st.integers(1024, 65536)), gpus=draw(st.sampled_from([0, 4, 8])),
                  board=draw(st.sampled_from(BOARDS)), driver=draw(st.sampled_from(["1", "2"])),
                  pools=draw(st.sampled_from([[], [], ["p1"]])))
             for index in range(draw(st.integers(1, 5)))]
    jobs = []
    for _ in range(draw(st.integers(1, 14))):
        job = draw(job_specs(sorted(flavors), [n.name for n in nodes]))
        # Checkpoint-resume jobs are pre-checked before they start: not simulated.
        jobs.append(msgspec.structs.replace(job, checkpoint_resume=None,
                                            priority=draw(st.sampled_from(["very-urgent", "urgent", "normal"])),
                                            duration=draw(st.sampled_from(DURATIONS))))
    return Workload(flavors, nodes, jobs, draw(st.integers(0, 4)))


@settings(SETTINGS, max_examples=400)
@given(st.one_of(busy_workloads(), varied_workloads()))
def test_with_runtimes_at_their_limits_every_job_starts_when_it_was_simulated_to(workload: Workload) -> None:
    scheduler = VirtualScheduler(workload.flavors)
    for node_info in workload.nodes:
        scheduler.record(NodeRegistered(node=node_info), NOW, service="monitor", aggregate=node_info.name)
    for index, job in enumerate(workload.jobs):
        scheduler.record(JobSubmitted(job_id=f"job-{index:012x}", spec=job, creator="alice"), NOW,
                         aggregate=f"job-{index:012x}")
    now: datetime | None = NOW
    simulated = None
    for instant in range(60):
        assert now is not None
        if instant == workload.snapshot_after:  # what a prediction made now sees
            state = scheduler.state
            simulated = simulate(node_capacity(state), cluster_flavors(state), running=running_jobs(state, now),
                                 queue=queued_jobs(state, now), now=now)
            before = dict(scheduler.started)
        scheduler.cycles(now)
        now = scheduler.next_end()
        if now is None:
            break
        scheduler.end_jobs(now)
    if simulated is None:
        return  # everything was over before the simulation would start
    real = {job_id: at for job_id, at in scheduler.started.items() if job_id not in before}
    assert {job_id: started.at for job_id, started in simulated.started.items()} == real
    assert set(simulated.waiting) == {job.job_id for job in scheduler.state.queue()}


CPU = {"cpu-4": CPU4}


def one_node() -> list[NodeCapacity]:
    return [node("a", cpus=4, memory_mib=8192)]


def test_a_job_waits_for_the_job_whose_end_frees_its_node_and_starts_then() -> None:
    big = run_on("big", ["a"], ends_in=7200)
    outcome = simulate(busy(one_node(), [big]), CPU, running=[big], queue=[queued("next", duration=3600)], now=NOW)
    assert outcome.started["next"].at == NOW + timedelta(hours=2)
    assert outcome.started["next"].waits_for == ["big"]
    assert outcome.ended["big"] == NOW + timedelta(hours=2)


def test_a_job_ending_before_its_limit_frees_its_node_then_and_runs_for_its_own_runtime() -> None:
    big = run_on("big", ["a"], ends_in=7200)
    outcome = simulate(busy(one_node(), [big]), CPU, running=[big], queue=[queued("next", duration=3600)], now=NOW,
                       ends={"big": NOW + timedelta(minutes=20)}, runtimes={"next": 600})
    assert outcome.started["next"].at == NOW + timedelta(minutes=20)
    assert outcome.ended["next"] == NOW + timedelta(minutes=30)


def test_a_runtime_past_the_limit_ends_at_the_limit() -> None:
    outcome = simulate(one_node(), CPU, queue=[queued("long", duration=600)], now=NOW, runtimes={"long": 3600})
    assert outcome.ended["long"] == NOW + timedelta(minutes=10)  # stopped there (J16)


def test_a_job_without_a_limit_holds_its_node_and_the_job_behind_never_starts() -> None:
    forever = run_on("forever", ["a"], ends_in=None)
    outcome = simulate(busy(one_node(), [forever]), CPU, running=[forever], queue=[queued("next", duration=3600)],
                       now=NOW)
    assert outcome.started == {} and outcome.waiting == ["next"]


def test_a_job_submitted_later_joins_the_queue_behind_its_priority_and_runs_then() -> None:
    first = run_on("first", ["a"], ends_in=3600)
    urgent = queued("urgent", duration=600, priority="urgent")
    outcome = simulate(busy(one_node(), [first]), CPU, running=[first], queue=[queued("waiting", duration=3600)],
                       now=NOW, arrivals=[Arrival(NOW + timedelta(minutes=30), urgent)])
    assert outcome.started["urgent"].at == NOW + timedelta(hours=1)  # ahead of the job that waited longer
    assert outcome.started["waiting"].at == NOW + timedelta(hours=1, minutes=10)


def test_a_simulation_stops_once_the_jobs_asked_about_have_started_and_goes_on_when_asked() -> None:
    queue = [queued(f"j{i}", duration=3600) for i in range(6)]
    simulation = Simulation(one_node(), CPU, queue=queue, now=NOW)
    outcome = simulation.run(until={"j2"})
    assert set(outcome.started) == {"j0", "j1", "j2"}
    assert outcome.now == NOW + timedelta(hours=2)
    assert simulation.run().started["j5"].at == NOW + timedelta(hours=5)


def test_a_job_that_fits_on_no_node_is_said_so_and_blocks_no_one() -> None:
    queue = [queued("huge", nodes=3, duration=600), queued("small", duration=600)]
    outcome = simulate(one_node(), CPU, queue=queue, now=NOW)
    assert outcome.unplaceable == {"huge"} and outcome.started["small"].at == NOW


def test_the_simulation_decides_on_as_many_waiting_jobs_as_a_cycle_does() -> None:
    assert Simulation([], {}, now=NOW).depth == CYCLE_DEPTH


def test_jobs_no_node_could_take_do_not_keep_the_jobs_behind_them_out_of_the_cycle() -> None:
    # More jobs than a cycle looks at wait for a pool no node serves; a job behind them fits on the idle node.
    held = [queued(f"held-{n}", pool="held") for n in range(CYCLE_DEPTH + 100)]
    simulation = Simulation([node("n1")], {"cpu-4": CPU4}, queue=[*held, queued("served")], now=NOW)
    outcome = simulation.run()
    assert outcome.started["served"].at == NOW
    assert len(outcome.waiting) == CYCLE_DEPTH + 100
