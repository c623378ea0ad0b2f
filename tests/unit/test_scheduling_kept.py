"""A cycle that uses what the last cycle over the same nodes kept (`Cluster.kept`: the capacity and its indexes brought
up to date, the running jobs' releases) decides exactly as one worked out from scratch, whatever changed in between:
time passed, jobs started, ended, arrived or left the queue, room on nodes was taken or freed."""

from __future__ import annotations

from datetime import datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.jobspec import JobSpec
from libs.placement import Cluster, Decision, NodeCapacity, QueuedJob, RunningJob, holdings, schedule
from tests.support.placement import NOW, node, run_on
from tests.support.strategies import SETTINGS, Scenario, job_specs, scenarios


class World:
    """The inputs of a cycle, changed step by step as a scheduler's state would be."""

    def __init__(self, scenario: Scenario) -> None:
        self.flavors: dict[str, Flavor] = scenario.flavors
        self.nodes: list[NodeCapacity] = list(scenario.nodes)
        self.running: list[RunningJob] = list(scenario.running)
        self.queue: list[QueuedJob] = list(scenario.queue)
        self.now: datetime = NOW
        self.made = 0

    def decide(self, cluster: Cluster | None) -> Decision:
        return schedule(self.queue, self.nodes, self.flavors, running=self.running, now=self.now, cluster=cluster)

    def change(self, held: dict[str, Resources], sign: int) -> None:
        self.nodes = [NodeCapacity(info=n.info, free=n.free + held[n.info.name] if sign > 0 else
                                   n.free - held[n.info.name]) if n.info.name in held else n
                      for n in self.nodes]

    def admit(self, decision: Decision) -> None:
        """The decision is carried out: its jobs run (in the order of the queue, as submitted), growths are left."""
        queued = {job.job_id: job for job in self.queue}
        for admission in decision.admissions:
            job, flavor = queued[admission.job_id], self.flavors[admission.flavor]
            ends = None if job.duration_seconds is None else self.now + timedelta(seconds=job.duration_seconds)
            self.running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor,
                                           placement=admission.placement, ends_at=ends))
            self.change(holdings(admission.placement, flavor), -1)
        admitted = {admission.job_id for admission in decision.admissions}
        self.queue = [job for job in self.queue if job.job_id not in admitted]


@SETTINGS
@given(scenarios(), st.data())
def test_a_kept_cycle_decides_as_one_from_scratch(scenario: Scenario, data: st.DataObject) -> None:
    world = World(scenario)
    cluster = Cluster(n.info for n in world.nodes)
    names = sorted(world.flavors)
    node_names = [n.info.name for n in world.nodes]
    for _ in range(data.draw(st.integers(1, 6))):
        kept = world.decide(cluster)
        assert kept == world.decide(None)
        step = data.draw(st.sampled_from(["admit", "end", "arrive", "leave", "time", "room", "same"]))
        if step == "admit":
            world.admit(kept)
        elif step == "end" and world.running:
            ended = world.running.pop(data.draw(st.integers(0, len(world.running) - 1)))
            world.change(holdings(ended.placement, ended.flavor), +1)
        elif step == "arrive":
            world.made += 1
            job = QueuedJob(f"new{world.made}", data.draw(job_specs(names, node_names)),
                            data.draw(st.sampled_from([None, 60, 300, 900, 3600])))
            world.queue.insert(data.draw(st.integers(0, len(world.queue))), job)
        elif step == "leave" and world.queue:
            world.queue.pop(data.draw(st.integers(0, len(world.queue) - 1)))
        elif step == "time":
            world.now += timedelta(seconds=data.draw(st.sampled_from([1, 60, 300, 1800, 7200])))
        elif step == "room" and world.nodes:
            name = data.draw(st.sampled_from(node_names))
            amount = Resources(cpus=data.draw(st.sampled_from([0.5, 1.0, 2.0])),
                               memory_mib=data.draw(st.integers(0, 1024)), accelerators=data.draw(st.integers(0, 1)))
            world.change({name: amount}, data.draw(st.sampled_from([-1, 1])))
    assert world.decide(cluster) == world.decide(None)


@SETTINGS
@given(scenarios())
def test_a_cycle_over_the_same_inputs_decides_the_same_again(scenario: Scenario) -> None:
    """Even with the same lists, as the scheduler passes them while nothing changed."""
    cluster = Cluster(n.info for n in scenario.nodes)
    fresh = schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW)
    for later in (0, 0, 600, 3600):
        now = NOW + timedelta(seconds=later)
        assert schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=now,
                        cluster=cluster) == (fresh if not later else schedule(
                            scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=now))


def test_a_backfill_refused_behind_one_head_is_tried_again_behind_another() -> None:
    """Nothing changed on the nodes, but a new head reserves other nodes: what a backfill may use is not the same,
    and a job that could not be backfilled behind the old head is tried again (and starts)."""
    small, mid, big = (Flavor(name=name, cpus=cpus, memory_mib=1024) for name, cpus in
                       (("small", 4), ("mid", 12), ("big", 16)))
    flavors = {flavor.name: flavor for flavor in (small, mid, big)}
    nodes = [node("a", cpus=16, memory_mib=65536), node("b", cpus=16, memory_mib=65536)]
    running = [run_on("on-a", ["a"], flavor=mid, ends_in=100), run_on("on-b", ["b"], flavor=big, ends_in=200)]
    for job in running:
        nodes = [NodeCapacity(info=n.info, free=n.free - job.held[n.info.name]) if n.info.name in job.held else n
                 for n in nodes]
    later = QueuedJob("later", JobSpec(name="j", flavors=["big"], command="c"), None)  # reserved node a at +100 s
    pinned = QueuedJob("pinned", JobSpec(name="j", flavors=["small"], command="c", node_names=["a"]), None)
    cluster = Cluster(n.info for n in nodes)
    first = schedule([later, pinned], nodes, flavors, running=running, now=NOW, cluster=cluster)
    assert first.admissions == [] and first.reservation is not None and first.reservation.nodes == ["a"]
    urgent = QueuedJob("urgent", JobSpec(name="j", flavors=["big"], command="c", node_names=["b"],
                                         priority="urgent"), None)
    queue = [urgent, later, pinned]
    kept = schedule(queue, nodes, flavors, running=running, now=NOW, cluster=cluster)
    assert kept == schedule(queue, nodes, flavors, running=running, now=NOW)
    assert [admission.job_id for admission in kept.admissions] == ["pinned"]
