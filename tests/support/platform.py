"""A scheduler on an in-memory event log, fed the monitor's and launcher's events the way its followers
would deliver them; with the cluster and the specs of the fault-handling tests."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from libs.contracts.cluster import ClusterConfig, Flavor, NodeInfo
from libs.contracts.events import (
    Event,
    EventEnvelope,
    InstanceDraining,
    InstanceKept,
    JobAdmitted,
    JobPrechecking,
    JobSubmitted,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeHealthy,
    NodeLost,
    NodeRegistered,
    NodeRetired,
    NodeUnhealthy,
    PerformanceDegraded,
    PrecheckCompleted,
    SettingsChanged,
)
from libs.contracts.health import ComponentHealth, NodeCheck
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef
from libs.contracts.operations.jobs import JobView
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import Tracking
from services.scheduler.domain.names import job_change, settings_change
from services.scheduler.domain.state import SchedulerState
from services.scheduler.service import Scheduler
from tests.support.eventlog import EventLog, fake_runtime

CPU4 = Flavor(name="cpu-4", cpus=4, memory_mib=8192)
CLUSTER = ClusterConfig(flavors=[CPU4])
POOL = "resilient"
JOB, OTHER = "job-000000000001", "job-000000000002"


def job_spec(nodes: int = 1, **changes: Any) -> JobSpec:
    base = JobSpec(name="train", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=["cpu-4"],
                   pool=POOL, algorithm=AlgorithmRef(name="code"), command="python3 train.py",
                   output=OutputRef(name="out"), checkpoint_resume=CheckpointResume(max_resumes=3))
    return msgspec.structs.replace(base, **changes)


def plain_spec(nodes: int = 1, **changes: Any) -> JobSpec:
    return job_spec(nodes, checkpoint_resume=None, **changes)


def check(node: str, *problems: str) -> NodeCheck:
    checks = [ComponentHealth(kind="board", name=p, healthy=False, detail="xid 79") for p in problems]
    return NodeCheck(node=node, passed=not problems, checks=checks)


class Platform:
    """A scheduler, and the monitor's, launcher's and autoscaler's events as its followers deliver them."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.scheduler = Scheduler(fake_runtime(self.log, "scheduler"), CLUSTER, clock=lambda: self.log.now)
        self.upstreams = {upstream.consumer: upstream for upstream in self.scheduler.upstreams()}

    @property
    def state(self) -> SchedulerState:
        return self.scheduler.state

    async def deliver(self, envelope: EventEnvelope) -> None:
        consumer = f"{envelope.service}-events"
        await self.scheduler.on_upstream(self.upstreams[consumer], envelope, None,
                                         Tracking(consumer, envelope.position))

    async def node(self, name: str, cpus: float = 4, pools: tuple[str, ...] = (POOL,)) -> None:
        info = NodeInfo(name=name, address=f"addr-{name}", cpus=cpus, memory_mib=65536, pools=list(pools))
        await self.deliver(self.log.record("monitor", "node", name, NodeRegistered(node=info)))

    async def node_event(self, event: NodeLost | NodeUnhealthy | NodeHealthy | NodeRetired) -> None:
        await self.deliver(self.log.record("monitor", "node", event.node_name, event))

    async def lose(self, name: str) -> None:
        await self.node_event(NodeLost(node_name=name, last_seen=self.log.now, reason="no heartbeat for 12s"))

    async def monitor(self, event: PrecheckCompleted | PerformanceDegraded) -> None:
        await self.deliver(self.log.record("monitor", "job", event.job_id, event))

    async def autoscaler(self, event: InstanceDraining | InstanceKept) -> None:
        await self.deliver(self.log.record("autoscaler", "instance", event.instance, event))

    async def launcher(self, event: LaunchSucceeded | LaunchFailed | LaunchStopped) -> None:
        await self.deliver(self.log.record("launcher", "launch", event.job_id, event))

    async def submit(self, job_id: str, spec: JobSpec) -> None:
        await self.scheduler.record([job_change(JobSubmitted(job_id=job_id, spec=spec, creator="alice"))])

    async def settings(self, **changes: Any) -> None:
        await self.scheduler.record([settings_change(SettingsChanged(settings=AdminSettings(**changes), by="root"))])

    async def cycle(self) -> None:
        await self.scheduler.run_cycle()

    async def start(self, job_id: str) -> JobAdmitted:
        """Place a checkpoint-resume job and pass its pre-check."""
        await self.cycle()
        precheck = self.last(job_id)
        assert isinstance(precheck, JobPrechecking), precheck
        await self.monitor(PrecheckCompleted(job_id=job_id, attempt=precheck.attempt, passed=True,
                                             nodes=[check(p.node) for p in precheck.placement]))
        admitted = self.last(job_id)
        assert isinstance(admitted, JobAdmitted), admitted
        return admitted

    def recorded(self, job_id: str) -> list[Event]:
        return cast(list[Event], self.log.of("scheduler", job_id))

    def last(self, job_id: str) -> Event:
        return self.recorded(job_id)[-1]

    def view(self, job_id: str) -> JobView:
        return self.state.view(self.state.jobs[job_id])

    def nodes_of(self, job_id: str) -> list[str]:
        return [p.node for p in self.state.jobs[job_id].placement]

    def replayed(self) -> SchedulerState:
        state = SchedulerState(CLUSTER)
        for envelope in self.log.envelopes:
            state.apply(envelope)
        return state
