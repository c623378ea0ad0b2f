"""Placement and the plain scheduling rules (SPEC S1, S4, S5, S9, S10, J8): eligible nodes, whole gangs,
flavors in order, elastic jobs and their growth.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import JobSpec
from libs.placement import (
    Capacity,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    eligible,
    place,
    place_gang,
)
from tests.support.placement import (
    CPU4,
    GPU4,
    GPU8,
    admitted,
    busy,
    cycle,
    elastic_spec,
    hosts,
    info,
    node,
    queued,
    run_on,
    spec,
)
from tests.support.strategies import SETTINGS

# --- place_gang: S4 ------------------------------------------------------------------------------------


def test_gang_ranks_are_numbered_and_carry_node_address_and_slots() -> None:
    placement = place_gang(spec(2, ["gpu-4"]), GPU4, [node("a", gpus=8), node("b", gpus=8)])
    assert placement is not None
    assert [(p.rank, p.node, p.address, p.slots) for p in placement] == [
        (0, "a", "addr-a", 4), (1, "b", "addr-b", 4)]


def test_cpu_flavor_ranks_have_one_slot() -> None:
    placement = place_gang(spec(1), CPU4, [node("a")])
    assert placement is not None and placement[0].slots == 1


def test_gang_spreads_over_equal_nodes() -> None:
    placement = place_gang(spec(3), CPU4, [node("a"), node("b"), node("c")])
    assert placement is not None
    assert sorted(p.node for p in placement) == ["a", "b", "c"]


def test_gang_spreads_even_when_one_node_is_much_bigger() -> None:
    placement = place_gang(spec(2), CPU4, [node("big", cpus=64), node("small", cpus=4)])
    assert placement is not None
    assert sorted(p.node for p in placement) == ["big", "small"]


def test_gang_packs_when_it_must() -> None:
    placement = place_gang(spec(3), CPU4, [node("big", cpus=8), node("small", cpus=4)])
    assert placement is not None
    assert Counter(p.node for p in placement) == {"big": 2, "small": 1}


def test_gang_is_all_or_nothing() -> None:
    # Room for two ranks of 4 CPUs in total, three asked for: nothing is placed.
    assert place_gang(spec(3), CPU4, [node("a", cpus=4), node("b", cpus=6)]) is None


def test_node_count_overrides_the_spec_size() -> None:
    placement = place_gang(spec(4), CPU4, [node("a", cpus=8)], node_count=2)
    assert placement is not None and len(placement) == 2
    assert place_gang(spec(4), CPU4, [node("a", cpus=8)]) is None


@pytest.mark.parametrize(
    ("free", "fits"),
    [
        (Resources(cpus=4, memory_mib=8192), True),
        (Resources(cpus=3.5, memory_mib=8192), False),
        (Resources(cpus=4, memory_mib=8191), False),
        (Resources(cpus=64, memory_mib=1_000_000, accelerators=0), True),
    ],
)
def test_a_node_takes_a_rank_only_if_every_resource_fits(free: Resources, fits: bool) -> None:
    capacity = NodeCapacity(info=info("a", cpus=64, memory_mib=1_000_000), free=free)
    assert (place_gang(spec(1), CPU4, [capacity]) is not None) == fits


def test_gang_needs_enough_accelerators() -> None:
    assert place_gang(spec(1, ["gpu-8"]), GPU8, [node("a", cpus=64, gpus=4)]) is None
    assert place_gang(spec(1, ["gpu-8"]), GPU8, [node("a", cpus=64, gpus=8)]) is not None


def test_fractional_cpus_add_up_without_rounding_trouble() -> None:
    half = Flavor(name="half", cpus=0.1, memory_mib=1)
    placement = place_gang(spec(10, ["half"]), half, [node("a", cpus=1.0)])
    assert placement is not None and len(placement) == 10


def test_gang_accepts_any_iterable_of_nodes() -> None:
    placement = place_gang(spec(2), CPU4, (n for n in [node("a"), node("b")]))
    assert placement is not None and sorted(p.node for p in placement) == ["a", "b"]


# --- eligible: S9 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node_kwargs", "spec_kwargs", "flavor", "ok"),
    [
        # node pinning
        ({}, {"node_names": ["a"]}, CPU4, True),
        ({}, {"node_names": ["b", "c"]}, CPU4, False),
        # dedicated pools serve only jobs that name them
        ({"pools": ["team-a"]}, {}, CPU4, False),
        ({"pools": ["team-a"]}, {"pool": "team-a"}, CPU4, True),
        ({"pools": ["team-b", "team-a"]}, {"pool": "team-a"}, CPU4, True),
        ({"pools": ["team-b"]}, {"pool": "team-a"}, CPU4, False),
        ({}, {"pool": "team-a"}, CPU4, False),
        # board and driver version for accelerator flavors
        ({"gpus": 8, "board": "A100"}, {}, GPU4, True),
        ({"gpus": 8, "board": "MLU370"}, {}, GPU4, False),
        ({"gpus": 8, "driver": "535.104"}, {"driver_version": "535.104"}, GPU4, True),
        ({"gpus": 8, "driver": "525.60"}, {"driver_version": "535.104"}, GPU4, False),
        ({"gpus": 8, "driver": None}, {"driver_version": "535.104"}, GPU4, False),
        # CPU flavors ignore boards and driver versions
        ({"gpus": 8, "board": "MLU370", "driver": "1.0"}, {"driver_version": "535.104"}, CPU4, True),
        ({}, {"driver_version": "535.104"}, CPU4, True),
    ],
)
def test_eligibility(node_kwargs: dict[str, Any], spec_kwargs: dict[str, Any], flavor: Flavor, ok: bool) -> None:
    assert eligible(info("a", **node_kwargs), spec(1, [flavor.name], **spec_kwargs), flavor) is ok


def test_accelerator_flavor_without_a_board_fits_any_board() -> None:
    anyboard = Flavor(name="any-4", cpus=4, memory_mib=1, accelerators=4)
    assert eligible(info("a", gpus=4, board="MLU370"), spec(1, ["any-4"]), anyboard)


def test_pinned_job_is_placed_only_on_its_nodes() -> None:
    decision = cycle([queued("j1", 2, node_names=["c", "a"])], [node("a"), node("b"), node("c")])
    assert sorted(hosts(decision.admissions[0])) == ["a", "c"]


def test_driver_version_picks_the_nodes_with_that_driver() -> None:
    nodes = [node("old", gpus=8, driver="525.60"), node("new", gpus=8, driver="535.104")]
    decision = cycle([queued("j", 1, ["gpu-4"], driver_version="535.104")], nodes)
    assert hosts(decision.admissions[0]) == ["new"]


def test_pool_job_waits_when_its_pool_has_no_room_even_if_other_nodes_are_free() -> None:
    nodes = busy([node("shared"), node("dedicated", cpus=4, pools=["team-a"])], [run_on("r", ["dedicated"])])
    decision = cycle([queued("j1", pool="team-a")], nodes)
    assert decision.admissions == []
    assert decision.reservation is not None and decision.reservation.nodes == ["dedicated"]


def test_pool_job_runs_on_its_pool() -> None:
    decision = cycle([queued("j1", pool="team-a")], [node("shared"), node("dedicated", pools=["team-a"])])
    assert hosts(decision.admissions[0]) == ["dedicated"]


def test_job_without_pool_never_lands_on_a_dedicated_node() -> None:
    nodes = [node("shared", cpus=4), node("dedicated", cpus=64, pools=["team-a"])]
    decision = cycle([queued("j1"), queued("j2")], nodes)
    assert [(a.job_id, hosts(a)) for a in decision.admissions] == [("j1", ["shared"])]


# --- schedule: S1 order, S4 gangs, S5 flavors ---------------------------------------------------------


def test_empty_queue_decides_nothing() -> None:
    assert cycle([], [node("a")]) == Decision(admissions=[], growths=[], reservation=None, unplaceable=[])


def test_jobs_are_admitted_in_the_given_order_until_capacity_runs_out() -> None:
    decision = cycle([queued("first"), queued("second"), queued("third")], [node("a", cpus=8)])
    assert admitted(decision) == ["first", "second"]
    assert decision.reservation is not None and decision.reservation.job_id == "third"


def test_a_job_that_does_not_fit_holds_back_jobs_that_would_delay_it() -> None:
    # After "small" (no duration limit), the two nodes have room for 3 ranks; "big" needs 4 and is
    # reserved all of it, so "tiny" (no limit either) must wait behind it.
    queue = [queued("small"), queued("big", nodes=4), queued("tiny")]
    decision = cycle(queue, [node("a", cpus=8), node("b", cpus=8)])
    assert admitted(decision) == ["small"]
    assert decision.reservation is not None and decision.reservation.job_id == "big"


def test_earlier_admissions_use_up_capacity_for_later_ones() -> None:
    queue = [queued("j1", 2, ["gpu-8"]), queued("j2", 1, ["gpu-8"])]
    decision = cycle(queue, [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=8)])
    assert admitted(decision) == ["j1"]


def test_flavors_are_tried_in_order_and_the_first_that_fits_wins() -> None:
    nodes = [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=4)]
    assert cycle([queued("j", 1, ["gpu-4", "gpu-8"])], nodes).admissions[0].flavor == "gpu-4"
    assert cycle([queued("j", 1, ["gpu-8", "gpu-4"])], nodes).admissions[0].flavor == "gpu-8"


def test_the_other_flavors_are_dropped() -> None:
    decision = cycle([queued("j", 1, ["gpu-8", "retired", "gpu-4"])], [node("a", cpus=64, gpus=4)])
    (admission,) = decision.admissions
    assert admission.flavor == "gpu-4"
    assert admission.dropped_flavors == ["gpu-8", "retired"]


def test_next_flavor_is_used_when_the_first_cannot_place_the_whole_gang() -> None:
    nodes = [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=4)]
    (admission,) = cycle([queued("j", 2, ["gpu-8", "gpu-4"])], nodes).admissions
    assert admission.flavor == "gpu-4"
    assert sorted(hosts(admission)) == ["a", "b"]
    assert {p.slots for p in admission.placement} == {4}


def test_unknown_flavors_are_skipped() -> None:
    assert cycle([queued("j", 1, ["retired-flavor", "cpu-4"])], [node("a")]).admissions[0].flavor == "cpu-4"


def test_only_one_flavor_of_a_job_is_ever_admitted() -> None:
    decision = cycle([queued("j", 1, ["cpu-4", "gpu-4"])], [node("a", cpus=64, gpus=8)])
    assert len(decision.admissions) == 1


def test_admissions_are_not_marked_backfilled_when_nothing_waits() -> None:
    decision = cycle([queued("a"), queued("b")], [node("n")])
    assert [a.backfilled for a in decision.admissions] == [False, False]


# --- S10: elastic jobs ---------------------------------------------------------------------------------


def test_elastic_job_starts_on_fewer_nodes_when_the_full_count_does_not_fit() -> None:
    job = QueuedJob("e", elastic_spec(4, 2, pool="p"))
    decision = cycle([job], [node("a", cpus=4, pools=["p"]), node("b", cpus=4, pools=["p"]),
                             node("c", cpus=4, pools=["p"])])
    (admission,) = decision.admissions
    assert len(admission.placement) == 3  # the largest count that fits, not the minimum


def test_elastic_job_that_may_not_scale_down_waits_for_its_full_size() -> None:
    job = QueuedJob("e", elastic_spec(4, 2, pool="p", scale_down=False))
    decision = cycle([job], [node("a", cpus=4, pools=["p"]), node("b", cpus=4, pools=["p"]),
                             node("c", cpus=4, pools=["p"])])
    assert decision.admissions == []


def test_elastic_job_never_starts_below_its_minimum() -> None:
    job = QueuedJob("e", elastic_spec(4, 3, pool="p"))
    decision = cycle([job], [node("a", cpus=4, pools=["p"]), node("b", cpus=4, pools=["p"])])
    assert decision.admissions == []
    assert decision.unplaceable == ["e"]  # two nodes can never hold three ranks


def test_a_job_moved_back_to_the_queue_starts_short_like_any_elastic_job() -> None:
    # A requeued elastic job (J12) is an elastic job in the queue: it may come back on fewer nodes.
    job = QueuedJob("e", elastic_spec(3, 2, pool="p"), excluded_nodes=frozenset({"c"}))
    decision = cycle([job], [node("a", cpus=4, pools=["p"]), node("b", cpus=4, pools=["p"]),
                             node("c", cpus=4, pools=["p"])])
    (admission,) = decision.admissions
    assert sorted(hosts(admission)) == ["a", "b"]


def test_elastic_job_prefers_its_full_size_on_a_later_flavor_over_shrinking() -> None:
    job = QueuedJob("e", elastic_spec(2, 1, ["gpu-8", "gpu-4"], pool="p"))
    nodes = [node("a", cpus=64, gpus=8, pools=["p"]), node("b", cpus=64, gpus=4, pools=["p"])]
    (admission,) = cycle([job], nodes).admissions
    assert (admission.flavor, len(admission.placement)) == ("gpu-4", 2)


def test_elastic_job_shrinks_when_no_flavor_fits_its_full_size() -> None:
    # Room for 1 rank of gpu-8 or 3 of gpu-4: the larger count wins over the first flavor.
    job = QueuedJob("e", elastic_spec(4, 1, ["gpu-8", "gpu-4"], pool="p"))
    nodes = [node("a", cpus=64, gpus=8, pools=["p"]), node("b", cpus=64, gpus=4, pools=["p"])]
    (admission,) = cycle([job], nodes).admissions
    assert (admission.flavor, len(admission.placement)) == ("gpu-4", 3)


def test_shrunken_elastic_job_grows_when_room_frees_up() -> None:
    job_spec = elastic_spec(4, 1, pool="p")
    nodes = [node(n, cpus=4, pools=["p"]) for n in ("a", "b", "c", "d")]
    running = [run_on("e", ["a", "b"], job_spec=job_spec)]
    decision = cycle([], busy(nodes, running), running=running)
    (growth,) = decision.growths
    assert growth.job_id == "e" and growth.flavor == "cpu-4"
    assert sorted(p.node for p in growth.placement) == ["a", "b", "c", "d"]


def test_growth_takes_the_largest_count_that_fits() -> None:
    job_spec = elastic_spec(4, 1, pool="p")
    nodes = [node(n, cpus=4, pools=["p"]) for n in ("a", "b", "c")]
    running = [run_on("e", ["a"], job_spec=job_spec)]
    (growth,) = cycle([], busy(nodes, running), running=running).growths
    assert len(growth.placement) == 3


def test_no_growth_when_scaling_up_is_off_or_the_job_is_moving_or_full() -> None:
    nodes = [node(n, cpus=4, pools=["p"]) for n in ("a", "b", "c", "d")]
    running = [
        run_on("off", ["a"], job_spec=elastic_spec(2, 1, pool="p", scale_up=False)),
        run_on("moving", ["b"], job_spec=elastic_spec(2, 1, pool="p"), can_grow=False),
        run_on("full", ["c"], job_spec=elastic_spec(1, 1, pool="p")),
    ]
    assert cycle([], busy(nodes, running), running=running).growths == []


def test_growth_comes_after_admissions() -> None:
    job_spec = elastic_spec(3, 1, pool="p")
    nodes = [node(n, cpus=4, pools=["p"]) for n in ("a", "b", "c")]
    running = [run_on("e", ["a"], job_spec=job_spec)]
    decision = cycle([queued("new", pool="p")], busy(nodes, running), running=running)
    assert admitted(decision) == ["new"]
    (growth,) = decision.growths
    assert len(growth.placement) == 2  # the queued job took one of the two free nodes


def test_growth_does_not_take_the_heads_reserved_nodes() -> None:
    job_spec = elastic_spec(3, 1, pool="p")
    nodes = [node(n, cpus=4, pools=["p"]) for n in ("a", "b", "c", "d")]
    running = [run_on("e", ["a"], job_spec=job_spec), run_on("r", ["b"], ends_in=600)]
    # "head" needs 3 nodes: c, d are free, b frees up in 10 minutes; e must not grow onto c or d.
    decision = cycle([queued("head", 3, pool="p")], busy(nodes, running), running=running)
    assert decision.reservation is not None and sorted(decision.reservation.nodes) == ["b", "c", "d"]
    assert decision.growths == []


def test_growth_may_use_room_the_head_does_not_need() -> None:
    nodes = [node(n, cpus=4) for n in ("a", "b", "c", "d", "e")]
    running = [run_on("elastic", ["a"], job_spec=elastic_spec(2, 1)), run_on("r", ["b"], ends_in=600)]
    # The head is pinned to b, c, d and waits for b; e is free and nobody else needs it.
    decision = cycle([queued("head", 3, node_names=["b", "c", "d"])], busy(nodes, running), running=running)
    assert decision.reservation is not None and sorted(decision.reservation.nodes) == ["b", "c", "d"]
    (growth,) = decision.growths
    assert sorted(p.node for p in growth.placement) == ["a", "e"]


# --- J8: TensorFlow parameter servers -----------------------------------------------------------------


def tf_spec(workers: int, parameter_servers: int) -> JobSpec:
    return JobSpec(name="tf", mode="tensorflow", nodes=workers, parameter_servers=parameter_servers,
                   flavors=["gpu-4"], command="python3 train.py")


def test_parameter_servers_are_placed_after_the_workers_with_the_fixed_flavor() -> None:
    placement = place_gang(tf_spec(2, 2), GPU4, [node("a", gpus=4), node("b", gpus=4)])
    assert placement is not None
    assert [(p.rank, p.role, p.slots) for p in placement] == [(0, "worker", 4), (1, "worker", 4),
                                                              (2, "ps", 1), (3, "ps", 1)]


def test_a_parameter_server_needs_one_cpu_and_one_gib_of_its_own() -> None:
    # Each node has room for one worker (8 CPUs) and nothing left over for a parameter server.
    tight = [node("a", cpus=8, gpus=4), node("b", cpus=8, gpus=4)]
    assert place_gang(tf_spec(2, 1), GPU4, tight) is None
    roomy = [node("a", cpus=9, memory_mib=33792, gpus=4), node("b", cpus=8, gpus=4)]
    placement = place_gang(tf_spec(2, 1), GPU4, roomy)
    assert placement is not None and [(p.node, p.role) for p in placement][-1] == ("a", "ps")


def test_the_cycle_charges_parameter_servers_their_own_flavor() -> None:
    (admission,) = cycle([QueuedJob("tf", tf_spec(1, 1))], [node("a", cpus=10, gpus=4)]).admissions
    assert [p.role for p in admission.placement] == ["worker", "ps"]
    # 8 CPUs for the worker and 1 for the parameter server leave 1: a cpu-4 job does not fit.
    decision = cycle([QueuedJob("tf", tf_spec(1, 1)), queued("cpu", flavors=["cpu-4"])], [node("a", cpus=10, gpus=4)])
    assert admitted(decision) == ["tf"]


# --- M6: nodes a job was moved away from ----------------------------------------------------------------


def test_an_excluded_node_is_never_chosen_even_when_it_is_the_roomiest() -> None:
    job = QueuedJob("j", spec(2), excluded_nodes=frozenset({"big"}))
    (admission,) = cycle([job], [node("big", cpus=64), node("a"), node("b")]).admissions
    assert sorted(hosts(admission)) == ["a", "b"]


def test_a_job_whose_only_nodes_are_excluded_waits_without_blocking_others() -> None:
    excluded = QueuedJob("moved", spec(1), excluded_nodes=frozenset({"a"}))
    decision = cycle([excluded, queued("next")], [node("a")])
    assert (admitted(decision), decision.unplaceable) == (["next"], ["moved"])


def test_a_growing_job_never_lands_on_an_excluded_node() -> None:
    job_spec = elastic_spec(2, 1, pool="p")
    running = RunningJob(job_id="e", spec=job_spec, flavor=CPU4, excluded_nodes=frozenset({"b"}),
                         placement=[Placement(rank=0, node="a", address="addr-a", slots=1)], ends_at=None)
    nodes = busy([node("a", cpus=4, pools=["p"]), node("b", cpus=4, pools=["p"])], [running])
    assert cycle([], nodes, running=[running]).growths == []
    nodes.append(node("c", cpus=4, pools=["p"]))
    (growth,) = cycle([], nodes, running=[running]).growths
    assert sorted(p.node for p in growth.placement) == ["a", "c"]


# --- D1 locality: a job goes where its data is cached, among the nodes it fits on ---------------------------


def test_a_job_goes_to_the_nodes_whose_caches_hold_most_of_its_data() -> None:
    nodes = [node("a"), node("b"), node("c"), node("d")]
    two = QueuedJob("j", spec(2), prefer={"c": 5_000, "d": 9_000, "a": 1})
    assert sorted(hosts(admitted_one(cycle([two], nodes)))) == ["c", "d"]
    roomier_without_data = [node("a", cpus=64), node("b", cpus=8)]
    one = QueuedJob("k", spec(1), prefer={"b": 1})
    assert hosts(admitted_one(cycle([one], roomier_without_data))) == ["b"]


def test_locality_still_spreads_a_job_and_takes_no_node_it_does_not_fit() -> None:
    nodes = [node("a", cpus=8), node("b", cpus=4), node("c", cpus=16)]
    job = QueuedJob("j", spec(2), prefer={"a": 10**9, "b": 10**6})
    assert sorted(hosts(admitted_one(cycle([job], nodes)))) == ["a", "b"]  # one rank per node first
    full = [node("a", cpus=2), node("c", cpus=16)]
    assert hosts(admitted_one(cycle([QueuedJob("k", spec(1), prefer={"a": 10**9})], full))) == ["c"]


def admitted_one(decision: Decision) -> Any:
    [admission] = decision.admissions
    return admission


@settings(SETTINGS, max_examples=300)
@given(st.lists(st.tuples(st.sampled_from([0, 2, 4, 8, 16]), st.integers(0, 3)), min_size=1, max_size=8),
       st.integers(1, 4))
def test_locality_changes_where_a_job_goes_never_whether_it_fits(shapes: list[tuple[int, int]], size: int) -> None:
    nodes = [node(f"n{i}", cpus=cpus) for i, (cpus, _) in enumerate(shapes)]
    cached = {f"n{i}": weight * 1000 for i, (_, weight) in enumerate(shapes) if weight}
    plain = place_gang(spec(size), CPU4, nodes)
    local = place(Capacity.of(nodes), spec(size), CPU4, size, prefer=cached)
    assert (plain is None) == (local is None)
    if plain is not None and local is not None:  # every rank fits where it went, and it spreads before it packs
        room = {n.info.name: n.free.cpus for n in nodes}
        used = Counter(p.node for p in local)
        assert all(room[name] >= 4 * count for name, count in used.items())
        assert max(used.values()) - min(used.values(), default=0) <= max(Counter(p.node for p in plain).values())
