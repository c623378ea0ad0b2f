"""The autoscaler's state: its instances (its own events), and the demand it reads from the others' logs.

Jobs come from the shared job-lifecycle fold of the scheduler's events (libs.jobstatus): a job placed and
being pre-checked holds its nodes and asks for no new ones (M1); one requeued after a failed pre-check or
a fault (J12) waits again. Nodes come from the shared fold of the monitor's node events (libs.nodes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime

from libs.access import allowed
from libs.contracts.cluster import ClusterConfig, Resources
from libs.contracts.events import (
    EventEnvelope,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobPrechecking,
    NodeDrained,
    ProvisionFailed,
    WaitingJobsPacked,
)
from libs.contracts.identity import Identity
from libs.contracts.jobspec import PRIORITY_RANK
from libs.contracts.operations.autoscaler import ScaledInstance
from libs.jobstatus import JobLifecycle
from libs.nodes import NodeState, fold_node_event
from libs.placement import NodeCapacity, QueuedJob, RunningJob
from libs.placement import holdings as placement_holdings
from services.autoscaler.scaling import Demand


@dataclass
class Instance:
    name: str  # also its node's name
    instance_type: str
    provider: str
    jobs: list[str]
    requested_at: datetime
    provider_id: str | None = None
    ready_at: datetime | None = None
    draining_since: datetime | None = None
    drained: bool = False  # the scheduler acknowledged the drain (NodeDrained): it places nothing more there
    ended: str | None = None  # why it is gone: released, or it could not be started
    ended_at: datetime | None = None

    @property
    def on_the_way(self) -> bool:
        """Asked for, its agent not registered yet."""
        return self.ended is None and self.ready_at is None

    @property
    def alive(self) -> bool:
        return self.ended is None


@dataclass
class Cooldown:
    """A type whose instances could not be started (no capacity, a failing boot): not asked for before `until`."""

    failures: int
    until: datetime


@dataclass
class AutoscalerState:
    lifecycle: JobLifecycle = field(default_factory=JobLifecycle)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    # Per type whose instance could not start: its failures in a row and until when it waits (a start ends it).
    cooldowns: dict[str, Cooldown] = field(default_factory=dict)
    # Per node, when a job last started or stopped holding it (by the scheduler's clock): idle since then.
    last_held: dict[str, datetime] = field(default_factory=dict)
    # Jobs being pre-checked, and the nodes they hold meanwhile (M1).
    prechecking: dict[str, list[str]] = field(default_factory=dict)
    # Where the last decision packed each waiting job (job -> node -> what it holds there): the next one packs
    # it there first. Kept in the log (WaitingJobsPacked), so a restart packs as before.
    packing: dict[str, dict[str, Resources]] = field(default_factory=dict)

    # --- folds ----------------------------------------------------------------------------------------

    def apply(self, envelope: EventEnvelope) -> None:
        """Fold one of the autoscaler's own events."""
        event, at = envelope.event, envelope.recorded_at
        if isinstance(event, WaitingJobsPacked):
            for job_id in event.unpacked:
                self.packing.pop(job_id, None)
            self.packing.update({job_id: held for job_id, held in event.packed.items() if self._may_wait(job_id)})
            return
        if isinstance(event, InstanceRequested):
            self.instances[event.instance] = Instance(name=event.instance, instance_type=event.instance_type,
                                                      provider=event.provider, jobs=list(event.jobs),
                                                      requested_at=at)
            return
        instance = self.instances.get(getattr(event, "instance", ""))
        if instance is None:
            return
        if isinstance(event, InstanceLaunched):
            instance.provider_id = event.provider_id
            self.cooldowns.pop(instance.instance_type, None)  # the provider has capacity again
        elif isinstance(event, InstanceReady):
            instance.ready_at = at
        elif isinstance(event, InstanceDraining):
            instance.draining_since, instance.drained = at, False
        elif isinstance(event, InstanceKept):
            instance.draining_since, instance.drained = None, False
        elif isinstance(event, InstanceReleased | ProvisionFailed):
            instance.ended, instance.ended_at = event.reason, at
            if isinstance(event, ProvisionFailed) and event.retry_after is not None:
                self.cooldowns[event.instance_type] = Cooldown(failures=event.failures, until=event.retry_after)

    def apply_scheduler(self, envelope: EventEnvelope) -> None:
        event = envelope.event
        if isinstance(event, NodeDrained):
            instance = self.instances.get(event.instance)
            if instance is not None and instance.draining_since is not None:
                instance.drained = True
            return
        before = self.lifecycle.jobs.get(envelope.aggregate_id)
        held_before = set(before.nodes) if before is not None and before.status == "running" else set()
        held_before |= set(self.prechecking.get(envelope.aggregate_id, []))
        job = self.lifecycle.apply(envelope)
        if job is None:
            return
        if not self._may_wait(job.job_id):
            self.packing.pop(job.job_id, None)  # started or ended: its packing is done with
        if isinstance(event, JobPrechecking):
            self.prechecking[job.job_id] = [p.node for p in event.placement]
        elif job.status != "queued" or not job.held:
            self.prechecking.pop(job.job_id, None)
        held = set(job.nodes) if job.status == "running" else set()
        held |= set(self.prechecking.get(job.job_id, []))
        for node in held ^ held_before:
            self.last_held[node] = envelope.recorded_at

    def apply_monitor(self, envelope: EventEnvelope) -> None:
        fold_node_event(self.nodes, envelope.event)

    def _may_wait(self, job_id: str) -> bool:
        """Waiting, or not known yet (the logs are replayed side by side: a packing may come before its job)."""
        job = self.lifecycle.jobs.get(job_id)
        return job is None or (job.waiting and not job.deleted)

    # --- instances ------------------------------------------------------------------------------------

    def on_the_way(self) -> dict[str, str]:
        return {i.name: i.instance_type for i in self.instances.values() if i.on_the_way}

    def promised(self) -> dict[str, list[str]]:
        """The jobs each instance on its way was asked for."""
        return {i.name: list(i.jobs) for i in self.instances.values() if i.on_the_way}

    def alive_per_type(self) -> dict[str, int]:
        return dict(Counter(i.instance_type for i in self.instances.values() if i.alive))

    def cooling(self, now: datetime) -> set[str]:
        return {kind for kind, cooldown in self.cooldowns.items() if cooldown.until > now}

    def busy_nodes(self) -> set[str]:
        """Nodes a running job, or one being pre-checked, holds."""
        running = {node for job in self.lifecycle.jobs.values() if job.status == "running" for node in job.nodes}
        return running | {node for nodes in self.prechecking.values() for node in nodes}

    def idle_since(self, instance: Instance, busy: Collection[str]) -> datetime | None:
        """Since when no job holds a ready instance's node (none of `busy`, `busy_nodes()`); None while one does
        (or before it is ready)."""
        if instance.ready_at is None or instance.name in busy:
            return None
        last = self.last_held.get(instance.name)
        return max(instance.ready_at, last) if last is not None else instance.ready_at

    def to_launch(self) -> list[Instance]:
        """Requested, and not known started nor failed: the provider is asked (again: asking is idempotent)."""
        return [i for i in self.instances.values() if i.provider_id is None and i.ended is None]

    # --- demand ---------------------------------------------------------------------------------------

    def demand(self, cluster: ClusterConfig) -> Demand:
        """The waiting jobs in start order (S1: priority, then first come first served), the nodes that take
        work with what is free on them, and what running jobs hold."""
        flavors = {flavor.name: flavor for flavor in cluster.flavors}
        jobs = list(self.lifecycle.jobs.values())
        queue = [QueuedJob(j.job_id, j.spec) for j in sorted((j for j in jobs if j.waiting and not j.deleted),
                                                           key=lambda j: PRIORITY_RANK[j.spec.priority])]
        running: list[RunningJob] = []
        used: dict[str, Resources] = {}
        for job in jobs:
            flavor = flavors.get(job.flavor or "")
            if job.status != "running" or flavor is None:
                continue
            running.append(RunningJob(job_id=job.job_id, spec=job.spec, flavor=flavor, placement=list(job.placement),
                                      ends_at=None))
            for node, held in placement_holdings(job.placement, flavor).items():
                used[node] = used.get(node, Resources()) + held
        gone = {i.name for i in self.instances.values() if not i.alive or i.draining_since is not None}
        nodes = [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
                 for name, n in self.nodes.items() if n.schedulable and name not in gone]
        return Demand(queue=queue, nodes=nodes, running=running, flavors=flavors)

    # --- the queue status (A6) ------------------------------------------------------------------------

    @property
    def queued(self) -> dict[str, list[str]]:
        """Waiting jobs and the flavors each could use."""
        return {j.job_id: list(j.spec.flavors) for j in self.lifecycle.jobs.values() if j.waiting and not j.deleted}

    @property
    def running(self) -> set[str]:
        return {j.job_id for j in self.lifecycle.jobs.values() if j.status == "running" and not j.deleted}

    def viewable_jobs(self, identity: Identity) -> set[str]:
        """The jobs `identity` may see (J2: the scheduler's rule), of those an instance was asked for."""
        asked = {job for instance in self.instances.values() for job in instance.jobs}
        jobs = self.lifecycle.jobs
        return {job_id for job_id in asked if (job := jobs.get(job_id)) is not None and not job.deleted
                and allowed(identity, job.spec, job.creator, "view",
                            sharing_enabled=self.lifecycle.settings.sharing_enabled)}

    def instance_views(self) -> list[ScaledInstance]:
        busy = self.busy_nodes()
        return [ScaledInstance(name=i.name, instance_type=i.instance_type, provider=i.provider, since=i.requested_at,
                               state="draining" if i.draining_since else "ready" if i.ready_at
                               else "booting" if i.provider_id else "requested",
                               jobs=list(i.jobs), busy=i.name in busy, provider_id=i.provider_id)
                for i in self.instances.values() if i.alive]

    def queued_by_flavor(self) -> dict[str, int]:
        """Queued jobs per flavor they could use (a job with two flavors counts for both)."""
        counts: Counter[str] = Counter()
        for flavors in self.queued.values():
            counts.update(flavors)
        return dict(sorted(counts.items()))
