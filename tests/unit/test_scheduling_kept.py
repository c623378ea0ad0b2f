"""A cycle that uses what the last cycle over the same nodes kept (`Cluster.kept`: the capacity and its indexes brought
up to date, the running jobs' releases) decides exactly as one worked out from scratch, whatever changed in between:
time passed, jobs started, ended, arrived or left the queue, room on nodes was taken or freed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs import placement
from libs.contracts.cluster import Flavor, Resources
from libs.contracts.jobspec import JobSpec
from libs.placement import Cluster, Decision, NodeCapacity, QueuedJob, RunningChange, RunningJob, holdings, schedule
from tests.support.placement import NOW, busy, node, run_on
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
        # The running jobs as the last kept cycle was given them, and how they changed since (as a scheduler's state
        # tells its cycle: `RunningChange`); None: the cycle is not told, and compares the lists.
        self.tell = False
        self.given: list[RunningJob] | None = None
        self.gone: list[RunningJob] = []
        self.added: list[RunningJob] = []

    def decide(self, cluster: Cluster | None) -> Decision:
        if cluster is None:
            return schedule(self.queue, self.nodes, self.flavors, running=self.running, now=self.now)
        given = list(self.running)
        change = RunningChange(self.given, self.gone, self.added) if self.tell and self.given is not None else None
        self.given, self.gone, self.added = given, [], []
        with pytest.MonkeyPatch.context() as patch:
            if change is not None:  # told how they changed, a cycle compares no lists
                patch.setattr(placement._Held, "then", lambda *_: pytest.fail("the running jobs were compared"))
            return schedule(self.queue, self.nodes, self.flavors, running=given, now=self.now, cluster=cluster,
                            running_change=change)

    def end(self, index: int) -> RunningJob:
        ended = self.running.pop(index)
        if ended in self.added:
            self.added.remove(ended)
        else:
            self.gone.append(ended)
        return ended

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
            self.added.append(self.running[-1])
            self.change(holdings(admission.placement, flavor), -1)
        admitted = {admission.job_id for admission in decision.admissions}
        self.queue = [job for job in self.queue if job.job_id not in admitted]


@contextmanager
def counted_exactly() -> Iterator[None]:
    """A kept cycle's search by counting (`_CountedKept`) finds each head's start itself: were its count off, the
    placement it makes to check it would send the search over instants to decide, and the decision would be the same,
    only slower."""
    fell_back: list[str] = []
    counted = placement._CountedKept.first_fit

    def checked(self: placement._CountedKept, job: QueuedJob, *args: object) -> object:
        found = counted(self, job, *args)  # type: ignore[arg-type]
        if found is None:
            fell_back.append(job.job_id)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement._CountedKept, "first_fit", checked)
        yield
    assert fell_back == []


@SETTINGS
@given(scenarios(), st.data())
def test_a_kept_cycle_decides_as_one_from_scratch(scenario: Scenario, data: st.DataObject) -> None:
    with counted_exactly():
        changed_step_by_step(scenario, data)


def changed_step_by_step(scenario: Scenario, data: st.DataObject) -> None:
    world = World(scenario)
    world.tell = data.draw(st.booleans())
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
            ended = world.end(data.draw(st.integers(0, len(world.running) - 1)))
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


def test_room_taken_on_a_node_outside_the_cycle_moves_the_reservation_counted_from_kept_releases() -> None:
    """What is free on a node changed though no job started or ended there (a process outside the platform took
    room): the releases kept for that node are summed again from what is free now, and the head's start moves."""
    mid, big = Flavor(name="mid", cpus=12, memory_mib=1024), Flavor(name="big", cpus=16, memory_mib=1024)
    flavors = {flavor.name: flavor for flavor in (mid, big)}
    running = [run_on("on-a", ["a"], flavor=mid, ends_in=100), run_on("on-b", ["b"], flavor=big, ends_in=200)]
    nodes = busy([node("a", cpus=16, memory_mib=65536), node("b", cpus=16, memory_mib=65536)], running)
    head = [QueuedJob("head", JobSpec(name="j", flavors=["big"], command="c"), None)]
    cluster = Cluster(n.info for n in nodes)
    with counted_exactly():
        first = schedule(head, nodes, flavors, running=running, now=NOW, cluster=cluster)
        assert first.reservation is not None and first.reservation.nodes == ["a"]
        assert first.reservation.start == NOW + timedelta(seconds=100)
        taken = [NodeCapacity(info=n.info, free=n.free - Resources(cpus=4)) if n.info.name == "a" else n
                 for n in nodes]
        later = schedule(head, taken, flavors, running=running, now=NOW, cluster=cluster)
    assert later == schedule(head, taken, flavors, running=running, now=NOW)
    assert later.reservation is not None and later.reservation.nodes == ["b"]
    assert later.reservation.start == NOW + timedelta(seconds=200)


def test_room_taken_at_the_instant_a_head_was_reserved_at_moves_it_to_another_node() -> None:
    """The head's start stays the same but its node has less room then: what is free at that instant, kept from the
    last cycle, is set anew on that node, and the head goes to the other one."""
    big = Flavor(name="big", cpus=16, memory_mib=1024)
    running = [run_on("on-a", ["a"], flavor=big, ends_in=100), run_on("on-b", ["b"], flavor=big, ends_in=100)]
    nodes = busy([node("a", cpus=16, memory_mib=65536), node("b", cpus=16, memory_mib=65536)], running)
    head = [QueuedJob("head", JobSpec(name="j", flavors=["big"], command="c"), None)]
    cluster = Cluster(n.info for n in nodes)
    with counted_exactly():
        first = schedule(head, nodes, {"big": big}, running=running, now=NOW, cluster=cluster)
        assert first.reservation is not None and first.reservation.nodes == ["a"]
        taken = [NodeCapacity(info=n.info, free=n.free - Resources(cpus=4)) if n.info.name == "a" else n
                 for n in nodes]
        later = schedule(head, taken, {"big": big}, running=running, now=NOW, cluster=cluster)
    assert later == schedule(head, taken, {"big": big}, running=running, now=NOW)
    assert later.reservation is not None and later.reservation.nodes == ["b"]
    assert later.reservation.start == NOW + timedelta(seconds=100)


def test_a_head_that_looks_further_than_the_last_counts_each_release_once() -> None:
    """A search looks only as far as it needs, and what it worked out is kept up to that point: a release further
    out, on a node whose room changed meanwhile, is counted when a later head first looks that far, and once."""
    big = Flavor(name="big", cpus=16, memory_mib=1024)
    names = [f"n{index:02}" for index in range(40)]
    running = [run_on(f"on-{name}", [name], flavor=big, ends_in=10 * (index + 1)) for index, name in enumerate(names)]
    nodes = busy([node(name, cpus=17, memory_mib=65536) for name in names], running)
    one = QueuedJob("one", JobSpec(name="j", flavors=["big"], command="c"), None)
    cluster = Cluster(n.info for n in nodes)
    with counted_exactly():
        first = schedule([one], nodes, {"big": big}, running=running, now=NOW, cluster=cluster)
        assert first.reservation is not None and first.reservation.start == NOW + timedelta(seconds=10)
        # A process outside the platform takes the spare CPU of a node whose job ends far beyond that.
        taken = [NodeCapacity(info=n.info, free=n.free - Resources(cpus=1)) if n.info.name == "n34" else n
                 for n in nodes]
        many = QueuedJob("many", JobSpec(name="j", mode="pytorch", nodes=36, flavors=["big"], command="c"), None)
        later = schedule([many], taken, {"big": big}, running=running, now=NOW, cluster=cluster)
    assert later == schedule([many], taken, {"big": big}, running=running, now=NOW)
    assert later.reservation is not None and later.reservation.start == NOW + timedelta(seconds=360)


def test_what_a_cycle_keeps_of_releases_goes_with_the_jobs_that_ended() -> None:
    """A scheduler's cycles run for months: once the jobs that were running ended, nothing is kept of their releases
    (the room each kind of rank gained at their ends included), however far heads looked."""
    big = Flavor(name="big", cpus=16, memory_mib=1024)
    names = [f"n{index:02}" for index in range(20)]
    running = [run_on(f"on-{name}", [name], flavor=big, ends_in=10 * (index + 1)) for index, name in enumerate(names)]
    free = {n.info.name: n for n in busy([node(name, cpus=16, memory_mib=65536) for name in names], running)}
    head = [QueuedJob("many", JobSpec(name="j", mode="pytorch", nodes=20, flavors=["big"], command="c"), None)]
    cluster = Cluster(n.info for n in free.values())
    with counted_exactly():
        while running:
            decision = schedule(head, list(free.values()), {"big": big}, running=running, now=NOW, cluster=cluster)
            assert decision.reservation is not None
            ended = running.pop(0)
            for name, amount in ended.held.items():
                free[name] = NodeCapacity(info=free[name].info, free=free[name].free + amount)
        schedule(head, list(free.values()), {"big": big}, running=running, now=NOW, cluster=cluster)  # it starts
    assert cluster.kept is not None and cluster.kept.releases is not None
    kept = cluster.kept.releases
    kept.settle([], NOW)  # as the next head's reservation would
    assert kept.held == {} and kept.chains == {} and kept.steps == {}
    assert [kind.gains for kind in kept.gains.values()] == [{}]


def test_a_job_that_ended_as_the_cycle_is_told_no_longer_releases_anything() -> None:
    """Told that a job ended (`RunningChange`), a kept cycle stops counting what it held: a head that needs a whole
    node waits for the node's other job, not for the end the ended one would have reached."""
    half, whole = Flavor(name="half", cpus=16, memory_mib=1024), Flavor(name="whole", cpus=32, memory_mib=1024)
    flavors = {flavor.name: flavor for flavor in (half, whole)}
    early, late = run_on("early", ["a"], flavor=half, ends_in=100), run_on("late", ["a"], flavor=half, ends_in=300)
    running = [early, late]
    nodes = busy([node("a", cpus=32, memory_mib=65536)], running)
    head = [QueuedJob("head", JobSpec(name="j", flavors=["whole"], command="c"), None)]
    cluster = Cluster(n.info for n in nodes)
    with counted_exactly():
        first = schedule(head, nodes, flavors, running=running, now=NOW, cluster=cluster)
        assert first.reservation is not None and first.reservation.start == NOW + timedelta(seconds=300)
        freed = busy([node("a", cpus=32, memory_mib=65536)], [late])
        later = schedule(head, freed, flavors, running=[late], now=NOW + timedelta(seconds=10), cluster=cluster,
                         running_change=RunningChange(running, [early], []))
    assert later == schedule(head, freed, flavors, running=[late], now=NOW + timedelta(seconds=10))
    assert later.reservation is not None and later.reservation.start == NOW + timedelta(seconds=300)


def test_running_jobs_made_anew_are_told_from_those_the_last_cycle_was_given() -> None:
    """A scheduler started again in the same process (from a snapshot, say) makes its running jobs anew: equal to
    those the last cycle over the cluster was given, not the same objects. Told later that one of them ended, the
    cycle finds it among them and goes on from what it kept, rather than working everything out again."""
    half, whole = Flavor(name="half", cpus=16, memory_mib=1024), Flavor(name="whole", cpus=32, memory_mib=1024)
    flavors = {flavor.name: flavor for flavor in (half, whole)}
    running = [run_on("early", ["a"], flavor=half, ends_in=100), run_on("late", ["a"], flavor=half, ends_in=300)]
    nodes = busy([node("a", cpus=32, memory_mib=65536)], running)
    head = [QueuedJob("head", JobSpec(name="j", flavors=["whole"], command="c"), None)]
    cluster = Cluster(n.info for n in nodes)
    schedule(head, nodes, flavors, running=running, now=NOW, cluster=cluster)
    anew = [dataclasses.replace(job) for job in running]
    assert anew == running
    schedule(head, nodes, flavors, running=anew, now=NOW, cluster=cluster)  # a state made anew tells no change
    freed = busy([node("a", cpus=32, memory_mib=65536)], anew[1:])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement._Held, "__init__", lambda *_: pytest.fail("worked out afresh"))
        later = schedule(head, freed, flavors, running=anew[1:], now=NOW, cluster=cluster,
                         running_change=RunningChange(anew, [anew[0]], []))
    assert later == schedule(head, freed, flavors, running=anew[1:], now=NOW)
    assert later.reservation is not None and later.reservation.start == NOW + timedelta(seconds=300)
