"""A scheduler state folded from hand-made events, on a cluster of A100, V100 and CPU flavors."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from libs.contracts.cluster import Accelerators, ClusterConfig, Flavor, NodeInfo
from libs.contracts.events import EventEnvelope, JobAdmitted, JobSubmitted, NodeRegistered, Placement
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from services.scheduler.domain.state import SchedulerState

AT = datetime(2026, 1, 1, tzinfo=UTC)
A100_1 = Flavor(name="a100-1", cpus=4, memory_mib=16384, accelerators=1, board="A100")
A100_4 = Flavor(name="a100-4", cpus=16, memory_mib=65536, accelerators=4, board="A100")
V100_2 = Flavor(name="v100-2", cpus=8, memory_mib=32768, accelerators=2, board="V100")
CPU_4 = Flavor(name="cpu-4", cpus=4, memory_mib=8192)
CLUSTER = ClusterConfig(flavors=[A100_1, A100_4, V100_2, CPU_4])


class Fold:
    def __init__(self) -> None:
        self.state = SchedulerState(CLUSTER)
        self.position = 0

    def apply(self, event: Any, service: str = "scheduler", aggregate: str = "x") -> None:
        self.position += 1
        self.state.apply(EventEnvelope(event_id=str(self.position), service=service, aggregate_type="t",
                                       aggregate_id=aggregate, version=self.position, position=self.position,
                                       recorded_at=AT, event=event))

    def node(self, name: str, board: str | None = None, boards: int = 0) -> None:
        accelerators = [Accelerators(board=board, count=boards, driver_version="535.1")] if board else []
        self.apply(NodeRegistered(node=NodeInfo(name=name, address=name, os="Debian 12", kernel="6.1.0", cpus=32,
                                                memory_mib=131072, accelerators=accelerators)), "monitor")

    def job(self, job_id: str, name: str, flavors: list[str], nodes: int = 1, **extra: Any) -> None:
        spec = JobSpec(name=name, nodes=nodes, mode="pytorch" if nodes > 1 else "single-node", flavors=flavors,
                       algorithm=AlgorithmRef(name="code"), command="python3 t.py", output=OutputRef(name="o"),
                       **extra)
        self.apply(JobSubmitted(job_id=job_id, spec=spec, creator="alice"))

    def admit(self, job_id: str, flavor: str, nodes: list[str]) -> None:
        placement = [Placement(rank=r, node=n, address=n, slots=1) for r, n in enumerate(nodes)]
        self.apply(JobAdmitted(job_id=job_id, attempt=1, flavor=flavor, placement=placement))
