"""The autoscaler's state: its instances (its own events), and the demand it reads from the others' logs.

Jobs come from the shared job-lifecycle fold of the scheduler's events (libs.jobstatus): a job placed and
being pre-checked holds its nodes and asks for no new ones (M1); one requeued after a failed pre-check or
a fault (J12) waits again. Nodes come from the shared fold of the monitor's node events (libs.nodes).

What is looked at on every decision is kept as the fold goes, so that its cost follows what is under way rather
than all that ever was: the jobs not ended, the instances not ended and their count per type and state. A job the
scheduler archives (JobArchived: it ended longer ago than the administrator's retention) leaves the state, and so
does an ended instance once every job it was asked for has, with its node and the version of its log
(`instance_left`): memory stays flat however many jobs and instances pass through.

A snapshot holds the state as it stands (`saved`, `loaded`; libs.skeleton.snapshots): the jobs not ended and the
instances not ended are kept by name, as the same records the lifecycle and the instances hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

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
from libs.contracts.operations.autoscaler import ScaledInstance, ScaledInstanceState
from libs.jobstatus import JobLifecycle, JobRecord
from libs.nodes import NodeState, fold_node_event
from libs.placement import NodeCapacity, QueuedJob, RunningJob
from libs.placement import holdings as placement_holdings
from libs.skeleton.snapshots import SavedLifecycle, load_lifecycle, save_lifecycle
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

    @property
    def state(self) -> ScaledInstanceState:
        """Where it is on its way to taking work, as shown (A6)."""
        return ("draining" if self.draining_since else "ready" if self.ready_at
                else "booting" if self.provider_id else "requested")


@dataclass
class Cooldown:
    """A type whose instances could not be started (no capacity, a failing boot): not asked for before `until`."""

    failures: int
    until: datetime


def _kept_nowhere(name: str) -> None:
    """What a state alone does when an instance leaves it: nothing is kept beside it."""


@dataclass
class AutoscalerState:
    lifecycle: JobLifecycle = field(default_factory=JobLifecycle)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    # Every instance until it ended and every job it was asked for was archived; `live`, those not ended.
    instances: dict[str, Instance] = field(default_factory=dict)
    live: dict[str, Instance] = field(default_factory=dict)
    # The instances not ended, per (type, state): the gauge's counts.
    instance_counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Per job not archived, the instances of the state asked for it.
    asked: dict[str, list[str]] = field(default_factory=dict)
    # The jobs not ended, in the order they were submitted: all that a decision looks at.
    open_jobs: dict[str, JobRecord] = field(default_factory=dict)
    # Per type whose instance could not start: its failures in a row and until when it waits (a start ends it).
    cooldowns: dict[str, Cooldown] = field(default_factory=dict)
    # Per node, when a job last started or stopped holding it (by the scheduler's clock): idle since then.
    last_held: dict[str, datetime] = field(default_factory=dict)
    # Jobs being pre-checked, and the nodes they hold meanwhile (M1).
    prechecking: dict[str, list[str]] = field(default_factory=dict)
    # Where the last decision packed each waiting job (job -> node -> what it holds there): the next one packs
    # it there first. Kept in the log (WaitingJobsPacked), so a restart packs as before.
    packing: dict[str, dict[str, Resources]] = field(default_factory=dict)
    # Told the name of every instance that left the state, so that what is kept of it beside the state goes too.
    instance_left: Callable[[str], None] = field(default=_kept_nowhere, compare=False, repr=False)

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
            self._requested(Instance(name=event.instance, instance_type=event.instance_type, provider=event.provider,
                                     jobs=list(event.jobs), requested_at=at))
            return
        instance = self.instances.get(getattr(event, "instance", ""))
        if instance is None:
            return
        self._count(instance, -1)
        self._change(instance, envelope)
        self._count(instance, 1)
        if not instance.alive:
            self.live.pop(instance.name, None)
            self._leave_once_done(instance.name)

    def _change(self, instance: Instance, envelope: EventEnvelope) -> None:
        event, at = envelope.event, envelope.recorded_at
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

    def _requested(self, instance: Instance) -> None:
        if (earlier := self.instances.get(instance.name)) is not None:  # its name again: the new one replaces it
            self._count(earlier, -1)
            self._unask(earlier)
        self.instances[instance.name] = self.live[instance.name] = instance
        self._count(instance, 1)
        for job_id in dict.fromkeys(instance.jobs):
            self.asked.setdefault(job_id, []).append(instance.name)

    def _count(self, instance: Instance, change: int) -> None:
        if not instance.alive:
            return
        key = (instance.instance_type, instance.state)
        self.instance_counts[key] += change
        if self.instance_counts[key] <= 0:
            del self.instance_counts[key]

    def _unask(self, instance: Instance) -> None:
        for job_id in instance.jobs:
            names = self.asked.get(job_id)
            if names is not None and instance.name in names:
                names.remove(instance.name)
                if not names:
                    del self.asked[job_id]

    def _leave_once_done(self, name: str) -> None:
        """An ended instance leaves once every job it was asked for was archived (until then, its log page shows
        them), and takes its node along: released, it takes no work whatever the node's last word."""
        instance = self.instances.get(name)
        if instance is None or instance.alive or any(job_id in self.asked for job_id in instance.jobs):
            return
        del self.instances[name]
        self.live.pop(name, None)
        self.last_held.pop(name, None)
        self.nodes.pop(name, None)
        self.instance_left(name)

    def _archive(self, job_id: str) -> None:
        """The job ended long ago and left the lifecycle: nothing of it is kept, nor an ended instance only it
        still kept."""
        self.open_jobs.pop(job_id, None)
        self.packing.pop(job_id, None)
        self.prechecking.pop(job_id, None)
        for name in self.asked.pop(job_id, []):
            self._leave_once_done(name)

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
        if job.archived:
            self._archive(job.job_id)
            return
        if job.ended:
            self.open_jobs.pop(job.job_id, None)
        else:
            self.open_jobs[job.job_id] = job
        if not self._may_wait(job.job_id):
            self.packing.pop(job.job_id, None)  # started or ended: its packing is done with
        if isinstance(event, JobPrechecking):
            self.prechecking[job.job_id] = [p.node for p in event.placement]
        elif job.status != "queued" or not job.held:
            self.prechecking.pop(job.job_id, None)
        held = set(job.nodes) if job.status == "running" else set()
        held |= set(self.prechecking.get(job.job_id, []))
        for node in held ^ held_before:
            if node in self.instances:  # only an instance's idle time is looked at
                self.last_held[node] = envelope.recorded_at

    def apply_monitor(self, envelope: EventEnvelope) -> None:
        fold_node_event(self.nodes, envelope.event)

    def _may_wait(self, job_id: str) -> bool:
        """Waiting, or not known yet (the logs are replayed side by side: a packing may come before its job)."""
        job = self.lifecycle.jobs.get(job_id)
        return job is None or (job.waiting and not job.deleted)

    # --- snapshots --------------------------------------------------------------------------------------

    def saved(self) -> bytes:
        """The state as a snapshot holds it."""
        return _ENCODER.encode(self.to_save())

    def to_save(self) -> SavedAutoscalerState:
        return SavedAutoscalerState(
            lifecycle=save_lifecycle(self.lifecycle), nodes=self.nodes, instances=list(self.instances.values()),
            live=list(self.live), instance_counts=[(*key, count) for key, count in self.instance_counts.items()],
            asked=self.asked, open_jobs=list(self.open_jobs), cooldowns=self.cooldowns, last_held=self.last_held,
            prechecking=self.prechecking, packing=self.packing)

    @classmethod
    def loaded(cls, data: bytes, instance_left: Callable[[str], None] = _kept_nowhere) -> AutoscalerState:
        """The state `saved` wrote."""
        return cls.restored(_DECODER.decode(data), instance_left)

    @classmethod
    def restored(cls, saved: SavedAutoscalerState,
                 instance_left: Callable[[str], None] = _kept_nowhere) -> AutoscalerState:
        """The state `saved` holds."""
        lifecycle = load_lifecycle(saved.lifecycle)
        instances = {instance.name: instance for instance in saved.instances}
        return cls(lifecycle=lifecycle, nodes=saved.nodes, instances=instances,
                   live={name: instances[name] for name in saved.live},
                   instance_counts=Counter({(kind, state): count for kind, state, count in saved.instance_counts}),
                   asked=saved.asked, open_jobs={job_id: lifecycle.jobs[job_id] for job_id in saved.open_jobs},
                   cooldowns=saved.cooldowns, last_held=saved.last_held, prechecking=saved.prechecking,
                   packing=saved.packing, instance_left=instance_left)

    # --- instances ------------------------------------------------------------------------------------

    def on_the_way(self) -> dict[str, str]:
        return {i.name: i.instance_type for i in self.live.values() if i.on_the_way}

    def promised(self) -> dict[str, list[str]]:
        """The jobs each instance on its way was asked for."""
        return {i.name: list(i.jobs) for i in self.live.values() if i.on_the_way}

    def alive_per_type(self) -> dict[str, int]:
        return dict(Counter(i.instance_type for i in self.live.values()))

    def cooling(self, now: datetime) -> set[str]:
        return {kind for kind, cooldown in self.cooldowns.items() if cooldown.until > now}

    def busy_nodes(self) -> set[str]:
        """Nodes a running job, or one being pre-checked, holds."""
        running = {node for job in self.open_jobs.values() if job.status == "running" for node in job.nodes}
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
        return [i for i in self.live.values() if i.provider_id is None]

    # --- demand ---------------------------------------------------------------------------------------

    def demand(self, cluster: ClusterConfig) -> Demand:
        """The waiting jobs in start order (S1: priority, then first come first served), the nodes that take
        work with what is free on them, and what running jobs hold."""
        flavors = {flavor.name: flavor for flavor in cluster.flavors}
        jobs = list(self.open_jobs.values())
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
        nodes = [NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
                 for name, n in self.nodes.items() if n.schedulable and not self._leaving(name)]
        return Demand(queue=queue, nodes=nodes, running=running, flavors=flavors)

    def _leaving(self, node: str) -> bool:
        """The node is an instance released or being drained."""
        instance = self.instances.get(node)
        return instance is not None and (not instance.alive or instance.draining_since is not None)

    # --- the queue status (A6) ------------------------------------------------------------------------

    @property
    def queued(self) -> dict[str, list[str]]:
        """Waiting jobs and the flavors each could use."""
        return {j.job_id: list(j.spec.flavors) for j in self.open_jobs.values() if j.waiting and not j.deleted}

    @property
    def running(self) -> set[str]:
        return {j.job_id for j in self.open_jobs.values() if j.status == "running" and not j.deleted}

    def viewable_jobs(self, identity: Identity) -> set[str]:
        """The jobs `identity` may see (J2: the scheduler's rule), of those an instance was asked for."""
        jobs = self.lifecycle.jobs
        return {job_id for job_id in self.asked if (job := jobs.get(job_id)) is not None and not job.deleted
                and allowed(identity, job.spec, job.creator, "view",
                            sharing_enabled=self.lifecycle.settings.sharing_enabled)}

    def instance_views(self) -> list[ScaledInstance]:
        busy = self.busy_nodes()
        return [ScaledInstance(name=i.name, instance_type=i.instance_type, provider=i.provider, since=i.requested_at,
                               state=i.state, jobs=list(i.jobs), busy=i.name in busy, provider_id=i.provider_id)
                for i in self.live.values()]

    def queued_by_flavor(self) -> dict[str, int]:
        """Queued jobs per flavor they could use (a job with two flavors counts for both)."""
        counts: Counter[str] = Counter()
        for flavors in self.queued.values():
            counts.update(flavors)
        return dict(sorted(counts.items()))


class SavedAutoscalerState(msgspec.Struct, array_like=True):
    lifecycle: SavedLifecycle
    nodes: dict[str, NodeState]
    instances: list[Instance]  # in the order they were asked for
    live: list[str]
    instance_counts: list[tuple[str, str, int]]
    asked: dict[str, list[str]]
    open_jobs: list[str]  # in the order they were submitted
    cooldowns: dict[str, Cooldown]
    last_held: dict[str, datetime]
    prechecking: dict[str, list[str]]
    packing: dict[str, dict[str, Resources]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SavedAutoscalerState)
