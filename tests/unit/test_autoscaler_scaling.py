"""Scale-up by placement (SPEC A1, A2, A7): the autoscaler asks for the fewest instances that let waiting
jobs start, counts the ones on their way, keeps to its limits and names jobs no type can serve."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import (
    Accelerators,
    AutoscalerConfig,
    Flavor,
    InstanceNode,
    InstanceType,
    NodeInfo,
    Resources,
)
from libs.contracts.events import EventEnvelope, WaitingJobsPacked
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.eventstore import NewEvent
from libs.eventstore.store import MAX_EVENT_BYTES
from libs.placement import NodeCapacity, QueuedJob
from services.autoscaler.rules import packing, requested
from services.autoscaler.scaling import Demand, scale_up
from services.autoscaler.state import AutoscalerState
from tests.support.strategies import SETTINGS

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
CPU1 = Flavor(name="cpu-1", cpus=1, memory_mib=1024)
CPU4 = Flavor(name="cpu-4", cpus=4, memory_mib=4096)
GPU1 = Flavor(name="gpu-1", cpus=2, memory_mib=4096, accelerators=1, board="a100")
FLAVORS = {f.name: f for f in (CPU1, CPU4, GPU1)}
SMALL = InstanceType(name="cpu-small", provider="local", node=InstanceNode(cpus=4, memory_mib=8192),
                     flavors=["cpu-1", "cpu-4"], max_instances=10)
GPU = InstanceType(name="gpu", provider="local", flavors=["gpu-1"], max_instances=4,
                   node=InstanceNode(cpus=8, memory_mib=32768, accelerators=[Accelerators(board="a100", count=2)]))
CONFIG = AutoscalerConfig(max_instances=20, instance_types=[SMALL, GPU])
SUFFIXES = [f"{i:06x}" for i in range(64)]  # the random part of new instances' names


def job(job_id: str, flavor: str = "cpu-1", nodes: int = 1, **changes: object) -> QueuedJob:
    spec = JobSpec(name="j", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=[flavor],
                   algorithm=AlgorithmRef(name="a"), command="python3 t.py", output=OutputRef(name="o"))
    return QueuedJob(job_id, msgspec.structs.replace(spec, **changes))


def demand(*jobs: QueuedJob, nodes: list[NodeCapacity] | None = None) -> Demand:
    return Demand(queue=list(jobs), nodes=nodes or [], flavors=FLAVORS)


def up(found: Demand, config: AutoscalerConfig = CONFIG, on_the_way: dict[str, str] | None = None,
       alive: dict[str, int] | None = None, cooling: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    decided = scale_up(found, config, on_the_way=on_the_way or {}, alive=alive or {}, cooling=cooling,
                       suffixes=SUFFIXES, now=NOW)
    return [(r.instance_type, r.jobs) for r in decided.requests]


def test_a_gang_job_on_an_empty_pool_gets_all_its_nodes_at_once() -> None:
    assert up(demand(job("a", "cpu-4", nodes=2))) == [("cpu-small", ["a"]), ("cpu-small", ["a"])]


def test_small_jobs_share_an_instance_instead_of_one_each() -> None:
    requests = up(demand(*(job(f"j{i}") for i in range(6))))
    assert [kind for kind, _ in requests] == ["cpu-small", "cpu-small"]  # 4 CPUs each: 2 hold 6 jobs
    assert sorted(j for _, jobs in requests for j in jobs) == [f"j{i}" for i in range(6)]


def test_a_job_that_fits_on_a_registered_node_asks_for_nothing() -> None:
    idle = NodeCapacity(info=NodeInfo(name="n1", address="a", cpus=4, memory_mib=8192),
                        free=Resources(cpus=4, memory_mib=8192))
    assert up(demand(job("a"), nodes=[idle])) == []


def test_instances_on_their_way_count_as_capacity() -> None:
    assert up(demand(job("a"), job("b")), on_the_way={"cpu-small-1": "cpu-small"}, alive={"cpu-small": 1}) == []


def test_each_job_gets_a_type_that_serves_its_flavor() -> None:
    assert up(demand(job("c"))) == [("cpu-small", ["c"])]
    assert up(demand(job("g", "gpu-1"))) == [("gpu", ["g"])]


def test_an_instance_asked_for_one_job_takes_the_next_when_it_has_room_as_the_scheduler_would() -> None:
    assert up(demand(job("g", "gpu-1"), job("c"))) == [("gpu", ["g", "c"])]


def test_a_job_no_type_can_serve_is_named_and_not_provisioned_for() -> None:
    pinned = job("pinned", node_names=["n9"])
    pooled = job("pooled", pool="research")
    decided = scale_up(demand(pinned, pooled, job("ok")), CONFIG, on_the_way={}, alive={}, cooling=(),
                       suffixes=SUFFIXES, now=NOW)
    assert decided.unservable == ["pinned", "pooled"]
    assert [(r.instance_type, r.jobs) for r in decided.requests] == [("cpu-small", ["ok"])]


def test_a_type_in_cooldown_is_passed_over_for_the_next_that_serves_the_flavor() -> None:
    big = InstanceType(name="cpu-big", provider="local", node=InstanceNode(cpus=16, memory_mib=65536),
                       flavors=["cpu-1"], max_instances=2)
    config = AutoscalerConfig(instance_types=[SMALL, big])
    assert up(demand(job("a")), config, cooling=("cpu-small",)) == [("cpu-big", ["a"])]
    assert up(demand(job("a")), config, cooling=("cpu-small", "cpu-big")) == []


def test_limits_per_type_and_in_all_are_kept() -> None:
    many = demand(*(job(f"j{i}", "cpu-4") for i in range(8)))
    assert len(up(many, msgspec.structs.replace(CONFIG, max_instances=3))) == 3
    assert len(up(many, alive={"cpu-small": 8})) == 2  # 10 of that type at most
    assert up(demand(job("a", "cpu-4", nodes=3)), msgspec.structs.replace(CONFIG, max_instances=2)) == []


def test_the_cheapest_in_instances_wins_and_the_first_type_on_a_tie() -> None:
    big = InstanceType(name="cpu-big", provider="local", node=InstanceNode(cpus=16, memory_mib=65536),
                       flavors=["cpu-4"], max_instances=2)
    four = demand(*(job(f"j{i}", "cpu-4") for i in range(4)))
    assert up(four, AutoscalerConfig(instance_types=[SMALL, big])) == [("cpu-big", ["j0", "j1", "j2", "j3"])]
    assert up(demand(job("a", "cpu-4")), AutoscalerConfig(instance_types=[SMALL, big])) == [("cpu-small", ["a"])]


jobs = st.lists(st.tuples(st.sampled_from(["cpu-1", "cpu-4", "gpu-1"]), st.integers(1, 3)), max_size=12)


@settings(SETTINGS, max_examples=150)
@given(jobs, st.integers(0, 12), st.integers(0, 3))
def test_no_instance_is_asked_for_twice_and_the_limits_hold(shapes: list[tuple[str, int]], max_instances: int,
                                                            coming: int) -> None:
    """Whatever waits: no more instances than the limits allow, each asked for jobs it would hold, and a
    decision made again with them on their way asks for none of those jobs again (only, when the limits held
    the first back, for a job it could not make room for, that the instances on their way now let in)."""
    queue = [job(f"j{i}", flavor, nodes) for i, (flavor, nodes) in enumerate(shapes)]
    config = msgspec.structs.replace(CONFIG, max_instances=max_instances)
    on_the_way = {f"cpu-small-c{i}": "cpu-small" for i in range(coming)}
    decided = scale_up(demand(*queue), config, on_the_way=on_the_way, alive={"cpu-small": coming}, cooling=(),
                       suffixes=SUFFIXES, now=NOW)

    per_type = {kind.name: sum(1 for r in decided.requests if r.instance_type == kind.name)
                for kind in CONFIG.instance_types}
    assert per_type["cpu-small"] + coming <= SMALL.max_instances and per_type["gpu"] <= GPU.max_instances
    assert len(decided.requests) + coming <= max(max_instances, coming)
    assert all(r.jobs for r in decided.requests)

    again = scale_up(demand(*queue), config, on_the_way={**on_the_way, **{r.instance: r.instance_type
                                                                          for r in decided.requests}},
                     promised={r.instance: r.jobs for r in decided.requests}, nominated=decided.nominations,
                     alive={"cpu-small": coming + per_type["cpu-small"], "gpu": per_type["gpu"]}, cooling=(),
                     suffixes=SUFFIXES[len(decided.requests):], now=NOW)
    assert not {j for r in again.requests for j in r.jobs} & set(decided.nominations)
    if len(queue) == len(decided.nominations) + len(decided.unservable):
        assert again.requests == []


@settings(SETTINGS, max_examples=100)
@given(jobs)
def test_without_limits_every_waiting_job_gets_room(shapes: list[tuple[str, int]]) -> None:
    """With room in the limits, the instances asked for hold every job a type can serve, all at once."""
    queue = [job(f"j{i}", flavor, nodes) for i, (flavor, nodes) in enumerate(shapes)]
    roomy = AutoscalerConfig(max_instances=100, instance_types=[msgspec.structs.replace(SMALL, max_instances=50),
                                                                msgspec.structs.replace(GPU, max_instances=50)])
    decided = scale_up(demand(*queue), roomy, on_the_way={}, alive={}, cooling=(), suffixes=SUFFIXES, now=NOW)
    assert sorted({j for r in decided.requests for j in r.jobs}) == sorted(q.job_id for q in queue)


def _replayed(state: AutoscalerState, changes: list[NewEvent], log: list[EventEnvelope]) -> None:
    """Fold `changes` as the autoscaler records them, keeping them in `log` as stored (encoded, decoded)."""
    for change in changes:
        stored = msgspec.json.decode(msgspec.json.encode(EventEnvelope(
            event_id=f"e{len(log)}", service="autoscaler", aggregate_type=change.aggregate_type,
            aggregate_id=change.aggregate_id, version=len(log) + 1, position=len(log) + 1, recorded_at=NOW,
            event=change.event)), type=EventEnvelope)
        log.append(stored)
        state.apply(stored)


@settings(SETTINGS, max_examples=150)
@given(st.lists(jobs.filter(bool), min_size=1, max_size=4))
def test_a_restarted_autoscaler_packs_as_before_and_asks_for_nothing_more(batches: list[list[tuple[str, int]]]) -> None:
    """Jobs arrive in batches, a decision after each; the autoscaler is then started again from its log. It
    packs the waiting jobs where the one before did, so it asks for no instance the one before would not."""
    state, log, queue = AutoscalerState(), list[EventEnvelope](), list[QueuedJob]()
    used = 0
    for batch in batches:
        queue += [job(f"j{len(queue) + i}", flavor, nodes) for i, (flavor, nodes) in enumerate(batch)]
        decided = scale_up(demand(*queue), CONFIG, on_the_way=state.on_the_way(), promised=state.promised(),
                           nominated=state.packing, alive=state.alive_per_type(), cooling=(),
                           suffixes=SUFFIXES[used:], now=NOW)
        used += len(decided.requests)
        _replayed(state, requested(decided, CONFIG) + packing(state, decided), log)

    restarted = AutoscalerState()
    for envelope in log:
        restarted.apply(envelope)
    assert restarted.packing == state.packing
    continued, again = (scale_up(demand(*queue), CONFIG, on_the_way=s.on_the_way(), promised=s.promised(),
                                 nominated=s.packing, alive=s.alive_per_type(), cooling=(),
                                 suffixes=SUFFIXES[used:], now=NOW) for s in (state, restarted))
    assert again == continued
    assert packing(restarted, again) == packing(state, continued)
    if len(queue) == len(decided.nominations) + len(decided.unservable):  # the last held none back (limits)
        assert again.requests == [] and packing(restarted, again) == []


def test_a_burst_of_thousands_is_packed_in_events_within_the_size_limit() -> None:
    state = AutoscalerState()
    burst = [job(f"j{i:05d}") for i in range(2_500)]
    roomy = AutoscalerConfig(max_instances=1_000, instance_types=[msgspec.structs.replace(SMALL, max_instances=1_000)])
    decided = scale_up(demand(*burst), roomy, on_the_way={}, alive={}, cooling=(),
                       suffixes=[f"{i:06x}" for i in range(1_000)], now=NOW)
    changes = packing(state, decided)
    assert [len(c.event.packed) for c in changes if isinstance(c.event, WaitingJobsPacked)] == [1_000, 1_000, 500]
    assert all(len(msgspec.json.encode(c.event)) < MAX_EVENT_BYTES for c in changes)
