"""One scheduling cycle (SPEC S1, S4, S5, S9): strict queue order, all-or-nothing gangs, flavors in order."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Accelerators, Flavor, NodeInfo, Resources
from libs.contracts.jobspec import JobSpec
from services.scheduler.placement import Admission, NodeCapacity, QueuedJob, eligible, place_gang, schedule

CPU4 = Flavor(name="cpu-4", cpus=4, memory_mib=8192)
GPU4 = Flavor(name="gpu-4", cpus=8, memory_mib=32768, accelerators=4, board="A100")
GPU8 = Flavor(name="gpu-8", cpus=16, memory_mib=65536, accelerators=8, board="A100")
FLAVORS = {f.name: f for f in (CPU4, GPU4, GPU8)}


def info(name: str, cpus: float = 16, memory_mib: int = 65536, gpus: int = 0, board: str = "A100",
         driver: str | None = "535.104", pools: list[str] | None = None) -> NodeInfo:
    accelerators = [Accelerators(board=board, count=gpus, driver_version=driver)] if gpus else []
    return NodeInfo(name=name, address=f"addr-{name}", cpus=cpus, memory_mib=memory_mib,
                    accelerators=accelerators, pools=pools or [])


def node(name: str, **kwargs: Any) -> NodeCapacity:
    """A node with everything free."""
    node_info = info(name, **kwargs)
    return NodeCapacity(info=node_info, free=Resources.of_node(node_info))


def spec(nodes: int = 1, flavors: list[str] | None = None, **extra: Any) -> JobSpec:
    return JobSpec(name="j", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes,
                   flavors=flavors or ["cpu-4"], command="python3 train.py", **extra)


def queued(job_id: str, nodes: int = 1, flavors: list[str] | None = None, **extra: Any) -> QueuedJob:
    return QueuedJob(job_id, spec(nodes, flavors, **extra))


def hosts(admission: Admission) -> list[str]:
    return [p.node for p in admission.placement]


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
    admissions = schedule([queued("j1", 2, node_names=["c", "a"])], [node("a"), node("b"), node("c")], FLAVORS)
    assert sorted(hosts(admissions[0])) == ["a", "c"]


def test_pool_job_waits_for_its_pool_even_when_other_nodes_are_free() -> None:
    assert schedule([queued("j1", pool="team-a")], [node("a"), node("b", pools=["team-b"])], FLAVORS) == []


def test_job_without_pool_never_lands_on_a_dedicated_node() -> None:
    nodes = [node("shared", cpus=4), node("dedicated", cpus=64, pools=["team-a"])]
    admissions = schedule([queued("j1"), queued("j2")], nodes, FLAVORS)
    assert [(a.job_id, hosts(a)) for a in admissions] == [("j1", ["shared"])]


# --- schedule: S1 order, S4 gangs, S5 flavors ---------------------------------------------------------


def test_empty_queue_admits_nothing() -> None:
    assert schedule([], [node("a")], FLAVORS) == []


def test_jobs_are_admitted_in_the_given_order_until_capacity_runs_out() -> None:
    queue = [queued("first"), queued("second"), queued("third")]
    admissions = schedule(queue, [node("a", cpus=8)], FLAVORS)
    assert [a.job_id for a in admissions] == ["first", "second"]


def test_a_job_that_does_not_fit_blocks_the_jobs_behind_it() -> None:
    # After "small", the two nodes have room for 3 ranks; "big" needs 4 and "tiny" must wait behind it.
    queue = [queued("small"), queued("big", nodes=4), queued("tiny")]
    admissions = schedule(queue, [node("a", cpus=8), node("b", cpus=8)], FLAVORS)
    assert [a.job_id for a in admissions] == ["small"]


def test_head_of_line_blocking_holds_even_if_the_blocked_job_can_never_run() -> None:
    queue = [queued("huge", nodes=9), queued("small")]  # two nodes hold 8 ranks at most
    assert schedule(queue, [node("a"), node("b")], FLAVORS) == []


def test_earlier_admissions_use_up_capacity_for_later_ones() -> None:
    queue = [queued("j1", 2, ["gpu-8"]), queued("j2", 1, ["gpu-8"])]
    admissions = schedule(queue, [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=8)], FLAVORS)
    assert [a.job_id for a in admissions] == ["j1"]


def test_flavors_are_tried_in_order_and_the_first_that_fits_wins() -> None:
    nodes = [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=4)]
    both_fit = schedule([queued("j", 1, ["gpu-4", "gpu-8"])], nodes, FLAVORS)
    assert both_fit[0].flavor == "gpu-4"
    preferred_first = schedule([queued("j", 1, ["gpu-8", "gpu-4"])], nodes, FLAVORS)
    assert preferred_first[0].flavor == "gpu-8"


def test_next_flavor_is_used_when_the_first_cannot_place_the_whole_gang() -> None:
    nodes = [node("a", cpus=64, gpus=8), node("b", cpus=64, gpus=4)]
    admissions = schedule([queued("j", 2, ["gpu-8", "gpu-4"])], nodes, FLAVORS)
    assert admissions[0].flavor == "gpu-4"
    assert sorted(hosts(admissions[0])) == ["a", "b"]
    assert {p.slots for p in admissions[0].placement} == {4}


def test_unknown_flavors_are_skipped() -> None:
    admissions = schedule([queued("j", 1, ["retired-flavor", "cpu-4"])], [node("a")], FLAVORS)
    assert admissions[0].flavor == "cpu-4"


def test_only_one_flavor_of_a_job_is_ever_admitted() -> None:
    queue = [queued("j", 1, ["cpu-4", "gpu-4"])]
    admissions = schedule(queue, [node("a", cpus=64, gpus=8)], FLAVORS)
    assert len(admissions) == 1


# --- properties over random clusters and queues ---------------------------------------------------------

BOARDS = ["A100", "MLU370"]


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeCapacity], dict[str, Flavor]]:
    flavors: dict[str, Flavor] = {}
    for index in range(draw(st.integers(1, 4))):
        accelerators = draw(st.sampled_from([0, 0, 0, 1, 2, 4, 8]))
        flavors[f"f{index}"] = Flavor(
            name=f"f{index}", cpus=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0])),
            memory_mib=draw(st.integers(256, 8192)), accelerators=accelerators,
            board=draw(st.sampled_from([None, *BOARDS])) if accelerators else None)
    nodes: list[NodeCapacity] = []
    for index in range(draw(st.integers(0, 8))):
        gpus = draw(st.sampled_from([0, 4, 8]))
        node_info = info(f"n{index}", cpus=draw(st.sampled_from([2.0, 4.0, 8.0, 16.0, 32.0])),
                         memory_mib=draw(st.integers(1024, 131072)), gpus=gpus, board=draw(st.sampled_from(BOARDS)),
                         driver=draw(st.sampled_from(["1", "2"])),
                         pools=draw(st.sampled_from([[], [], [], ["p1"], ["p1", "p2"]])))
        total = Resources.of_node(node_info)
        used = Resources(cpus=draw(st.sampled_from([0.0, 0.5, 2.0])) if total.cpus > 2 else 0.0,
                         memory_mib=draw(st.integers(0, 512)),
                         accelerators=draw(st.integers(0, gpus)))
        nodes.append(NodeCapacity(info=node_info, free=total - used))
    return nodes, flavors


@st.composite
def queues(draw: st.DrawFn, flavor_names: list[str], node_names: list[str]) -> list[QueuedJob]:
    jobs: list[QueuedJob] = []
    for index in range(draw(st.integers(0, 8))):
        names = draw(st.lists(st.sampled_from([*flavor_names, *flavor_names, "unknown"]), min_size=1, max_size=3,
                             unique=True))
        extra: dict[str, Any] = {}
        restriction = draw(st.sampled_from(["none", "none", "none", "none", "pool", "pin", "driver"]))
        if restriction == "pool":
            extra["pool"] = draw(st.sampled_from(["p1", "p2"]))
        elif restriction == "pin" and node_names:
            extra["node_names"] = draw(st.lists(st.sampled_from(node_names), min_size=1, unique=True))
        elif restriction == "driver":
            extra["driver_version"] = draw(st.sampled_from(["1", "2"]))
        jobs.append(queued(f"j{index}", draw(st.sampled_from([1, 1, 2, 3, 4])), names, **extra))
    return jobs


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[NodeCapacity], dict[str, Flavor], list[QueuedJob]]:
    nodes, flavors = draw(clusters())
    return nodes, flavors, draw(queues(sorted(flavors), [n.info.name for n in nodes]))


PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_admissions_place_whole_gangs_without_overcommitting(
        scenario: tuple[list[NodeCapacity], dict[str, Flavor], list[QueuedJob]]) -> None:
    nodes, flavors, queue = scenario
    admissions = schedule(queue, nodes, flavors)
    by_name = {n.info.name: n for n in nodes}
    specs = {job.job_id: job.spec for job in queue}

    # S1 strict order: the admitted jobs are exactly the head of the queue.
    assert [a.job_id for a in admissions] == [j.job_id for j in queue[: len(admissions)]]

    used: dict[str, Resources] = {name: Resources() for name in by_name}
    for admission in admissions:
        job_spec = specs[admission.job_id]
        flavor = flavors[admission.flavor]
        # S5: a flavor the job asked for; S4: exactly spec.nodes ranks, numbered from 0.
        assert admission.flavor in job_spec.flavors
        assert [p.rank for p in admission.placement] == list(range(job_spec.nodes))
        for placed in admission.placement:
            assert placed.slots == flavor.slots
            assert placed.address == by_name[placed.node].info.address
            assert eligible(by_name[placed.node].info, job_spec, flavor)  # S9
            used[placed.node] = used[placed.node] + Resources.of_flavor(flavor)
    # No node gives out more than it had free.
    for name, amount in used.items():
        assert amount.fits_in(by_name[name].free), (name, amount, by_name[name].free)

    # The first job left waiting really cannot be placed on what remains, with any of its flavors.
    if len(admissions) < len(queue):
        blocked = queue[len(admissions)]
        remaining = [NodeCapacity(info=n.info, free=n.free - used[n.info.name]) for n in nodes]
        for name in blocked.spec.flavors:
            if name in flavors:
                assert place_gang(blocked.spec, flavors[name], remaining) is None


@PROPERTY_SETTINGS
@given(clusters(), st.integers(1, 6), st.data())
def test_property_place_gang_places_every_rank_or_none(
        cluster: tuple[list[NodeCapacity], dict[str, Flavor]], ranks: int, data: st.DataObject) -> None:
    nodes, flavors = cluster
    flavor = flavors[data.draw(st.sampled_from(sorted(flavors)))]
    job_spec = spec(ranks, [flavor.name])
    placement = place_gang(job_spec, flavor, nodes)
    need = Resources.of_flavor(flavor)
    fitting_slots = {n.info.name: 0 for n in nodes}
    for n in nodes:
        left = n.free
        while eligible(n.info, job_spec, flavor) and need.fits_in(left):
            fitting_slots[n.info.name] += 1
            left = left - need
    if placement is None:
        # Nothing placed only when the eligible nodes really lack room for every rank.
        assert sum(fitting_slots.values()) < ranks
        return
    assert len(placement) == ranks
    per_node = Counter(p.node for p in placement)
    for name, count in per_node.items():
        assert count <= fitting_slots[name]
    # Spread: no node takes a second rank while an eligible node with room has none.
    if max(per_node.values()) > 1:
        assert all(per_node[name] > 0 for name, slots in fitting_slots.items() if slots > 0)


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
    (admission,) = schedule([QueuedJob("tf", tf_spec(1, 1))], [node("a", cpus=10, gpus=4)], FLAVORS)
    assert [p.role for p in admission.placement] == ["worker", "ps"]
    # 8 CPUs for the worker and 1 for the parameter server leave 1: a cpu-4 job does not fit.
    assert schedule([QueuedJob("tf", tf_spec(1, 1)), queued("cpu", flavors=["cpu-4"])],
                    [node("a", cpus=10, gpus=4)], FLAVORS)[1:] == []
