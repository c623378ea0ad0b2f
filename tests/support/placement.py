"""Builders for the scheduling tests: flavors, nodes, specs, queued and running jobs, and one cycle.

Times are relative to NOW.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from libs.contracts.cluster import Accelerators, Flavor, NodeInfo, Resources
from libs.contracts.events import Placement
from libs.contracts.jobspec import CheckpointResume, Elastic, JobSpec
from libs.placement import (
    Admission,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    holdings,
    schedule,
)

NOW = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
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


def elastic_spec(nodes: int, min_nodes: int, flavors: list[str] | None = None, *, scale_up: bool = True,
                 scale_down: bool = True, **extra: Any) -> JobSpec:
    resume = CheckpointResume(elastic=Elastic(min_nodes=min_nodes, allow_scale_up=scale_up,
                                              allow_scale_down=scale_down))
    return spec(nodes, flavors, pool=extra.pop("pool", None), checkpoint_resume=resume, **extra)


def queued(job_id: str, nodes: int = 1, flavors: list[str] | None = None, *, duration: int | None = None,
           **extra: Any) -> QueuedJob:
    return QueuedJob(job_id, spec(nodes, flavors, **extra), duration)


def hosts(admission: Admission) -> list[str]:
    return [p.node for p in admission.placement]


def cycle(queue: list[QueuedJob], nodes: list[NodeCapacity], *, running: Sequence[RunningJob] = (),
          flavors: dict[str, Flavor] | None = None, now: datetime = NOW) -> Decision:
    return schedule(queue, nodes, flavors or FLAVORS, running=running, now=now)


def admitted(decision: Decision) -> list[str]:
    return [a.job_id for a in decision.admissions]


def run_on(job_id: str, where: list[str], *, job_spec: JobSpec | None = None, flavor: Flavor = CPU4,
           ends_in: int | None = None, can_grow: bool = True) -> RunningJob:
    """A running job with one worker rank on each node of `where`; `ends_in` seconds from NOW."""
    placement = [Placement(rank=i, node=n, address=f"addr-{n}", slots=flavor.slots) for i, n in enumerate(where)]
    return RunningJob(job_id=job_id, spec=job_spec or spec(len(where), [flavor.name]), flavor=flavor,
                      placement=placement, ends_at=NOW + timedelta(seconds=ends_in) if ends_in is not None else None,
                      can_grow=can_grow)


def busy(nodes: list[NodeCapacity], running: Sequence[RunningJob]) -> list[NodeCapacity]:
    """The nodes with what the running jobs hold taken off, as the service computes them."""
    used: dict[str, Resources] = {}
    for job in running:
        for name, amount in holdings(job.placement, job.flavor).items():
            used[name] = used.get(name, Resources()) + amount
    return [NodeCapacity(info=n.info, free=n.free - used.get(n.info.name, Resources())) for n in nodes]
