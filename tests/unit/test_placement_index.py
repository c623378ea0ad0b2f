"""`place` on a capacity that has lived through many changes (as a cycle's or a plan's does, with its
index of roomy nodes kept up to date lazily) places every rank where the rule it documents says."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs import placement
from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.events import Placement, Role
from libs.contracts.jobspec import JobSpec
from libs.placement import Capacity, Cluster, Decision, eligible, parameter_server_count, place, role_flavor, schedule
from tests.support.placement import NOW, info
from tests.support.strategies import BOARDS, SETTINGS, Scenario, flavor_sets, job_specs, scenarios


def by_the_rule(free: dict[str, Resources], infos: dict[str, NodeInfo], spec: JobSpec, flavor: Flavor,
                workers: int, exclude: frozenset[str]) -> list[Placement] | None:
    """Each rank on the eligible node where it fits that holds the fewest ranks of the job so far, then
    has the most free CPU left, then memory, then the first name; looking at every node each time."""
    worker_roles: list[Role] = ["worker"] * workers
    server_roles: list[Role] = ["ps"] * parameter_server_count(spec)
    roles = worker_roles + server_roles
    left = dict(free)
    ranks: dict[str, int] = {}
    placement: list[Placement] = []
    for rank, role in enumerate(roles):
        rank_flavor = role_flavor(role, flavor)
        need = Resources.of_flavor(rank_flavor)
        fitting = [name for name, node in infos.items()
                   if eligible(node, spec, rank_flavor, exclude) and need.fits_in(left[name])]
        if not fitting:
            return None
        name = min(fitting, key=lambda n: (ranks.get(n, 0), -left[n].cpus, -left[n].memory_mib, n))
        left[name] = left[name] - need
        ranks[name] = ranks.get(name, 0) + 1
        placement.append(Placement(rank=rank, node=name, address=infos[name].address, slots=rank_flavor.slots,
                                   role=role))
    return placement


Change = tuple[str, str, Resources]  # take or give, node, amount
Placing = tuple[str, JobSpec, str, int, frozenset[str]]  # place, spec, flavor, workers, nodes excluded
History = tuple[dict[str, Flavor], list[NodeInfo], list[Change | Placing]]


@st.composite
def histories(draw: st.DrawFn) -> History:
    """Nodes, flavors, and a run of changes to what is free (taken or given back) between placements."""
    flavors = draw(flavor_sets())
    infos = [info(f"n{index:02}", cpus=draw(st.sampled_from([4.0, 8.0, 16.0])),
                  memory_mib=draw(st.sampled_from([8192, 16384, 65536])), gpus=draw(st.sampled_from([0, 4, 8])),
                  board=draw(st.sampled_from(BOARDS)), driver=draw(st.sampled_from(["1", "2"])),
                  pools=draw(st.sampled_from([[], [], [], ["p1"]])))
             for index in range(draw(st.integers(1, 14)))]
    names = [i.name for i in infos]
    amounts = st.builds(lambda cpus, memory, boards: Resources(cpus=cpus, memory_mib=memory, accelerators=boards),
                        st.sampled_from([0.5, 1.0, 2.0, 4.0]), st.sampled_from([0, 1024, 4096]),
                        st.sampled_from([0, 0, 1, 4]))
    change = st.tuples(st.sampled_from(["take", "give"]), st.sampled_from(names), amounts)
    placing = st.tuples(st.just("place"), job_specs(sorted(flavors), names), st.sampled_from(sorted(flavors)),
                        st.integers(1, 5), st.frozensets(st.sampled_from(names), max_size=2))
    steps: list[Change | Placing] = draw(st.lists(st.one_of(change, change, change, placing), min_size=1,
                                                   max_size=60))
    return flavors, infos, steps


@settings(SETTINGS, max_examples=400)
@given(histories())
def test_a_placement_after_many_changes_follows_the_rule(history: History) -> None:
    flavors, infos, steps = history
    capacity = Capacity(Cluster(infos), {i.name: Resources.of_node(i) for i in infos})
    by_name = {i.name: i for i in infos}
    for step in steps:
        if len(step) == 5:
            _, spec, flavor_name, workers, exclude = step
            expected = by_the_rule(dict(capacity.free), by_name, spec, flavors[flavor_name], workers, exclude)
            assert place(capacity, spec, flavors[flavor_name], workers, exclude) == expected
        else:
            kind, name, amount = step
            (capacity.take if kind == "take" else capacity.give)({name: amount})


class _AfreshAtEachInstant:
    """What the head's reservation search looked at before: a capacity made afresh for each instant."""

    def __init__(self, free_now: Capacity, timed: list[Mapping[str, Resources]]) -> None:
        self.free_now, self.timed = free_now, timed

    def at(self, count: int) -> Capacity:
        capacity = self.free_now.copy()
        for held in self.timed[:count]:
            for name, amount in held.items():
                if name in capacity.free:
                    capacity.free[name] = capacity.free[name] + amount
        return capacity


@settings(SETTINGS, max_examples=300)
@given(scenarios())
def test_the_head_is_reserved_as_on_a_capacity_made_afresh_for_each_instant(scenario: Scenario) -> None:
    """The reservation search moves one capacity back and forth between instants; it must decide as if each
    instant's capacity were made anew (the same reservation, the same backfills behind it)."""
    def decide() -> Decision:
        return schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW)

    moved = decide()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement, "_Timeline", _AfreshAtEachInstant)
        afresh = decide()
    assert moved == afresh
