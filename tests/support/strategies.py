"""Hypothesis strategies for the scheduling tests: random flavors, job specs, and whole scenarios of
nodes, running jobs and a queue."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.jobspec import CheckpointResume, Elastic, JobSpec
from libs.placement import NodeCapacity, QueuedJob, RunningJob, holdings, place_gang
from tests.support.placement import NOW, info

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
