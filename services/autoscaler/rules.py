"""The autoscaler's rules, as pure functions of its state: the events to record for a scale-up decision,
for what the provider answered, for an instance's agent registering, and for instances that never came.

They never talk to a provider (service.py does, outside the lock) and never read a clock: `now` is given.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from libs.contracts.cluster import AutoscalerConfig, ClusterConfig, InstanceType, NodeInfo, Resources
from libs.contracts.events import (
    Event,
    EventEnvelope,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    NodeRegistered,
    ProvisionFailed,
    ReleaseCause,
    WaitingJobsPacked,
)
from libs.eventstore import NewEvent
from services.autoscaler.scaling import ScaleUp
from services.autoscaler.state import AutoscalerState, Instance

INSTANCE = "instance"  # the autoscaler's aggregate: one per instance (id = its name)
PACKING, QUEUE = "packing", "queue"  # where the waiting jobs are packed: one aggregate for the whole queue
# Jobs per WaitingJobsPacked event, which keeps a burst of thousands of jobs within an event's size limit.
PACKED_PER_EVENT = 1_000
# ClearML tries a type that failed again every poll: here a type whose instance could not be started waits
# 30 s, then twice as long after each further failure in a row, at most 10 minutes.
FIRST_COOLDOWN = timedelta(seconds=30)
LONGEST_COOLDOWN = timedelta(minutes=10)


def instance_events(name: str, *events: Event) -> list[NewEvent]:
    return [NewEvent(INSTANCE, name, event) for event in events]


def requested(decided: ScaleUp, config: AutoscalerConfig) -> list[NewEvent]:
    changes: list[NewEvent] = []
    for request in decided.requests:
        kind = config.instance_type(request.instance_type)
        if kind is not None:
            changes += instance_events(request.instance, InstanceRequested(
                instance=request.instance, instance_type=kind.name, provider=kind.provider, jobs=request.jobs))
    return changes


def packing(state: AutoscalerState, decided: ScaleUp) -> list[NewEvent]:
    """What changed in where the waiting jobs are packed, so a restarted autoscaler packs them as this one did
    (and does not ask again for room it already asked for)."""
    packed = {job: held for job, held in decided.nominations.items() if state.packing.get(job) != held}
    unpacked = [job for job in decided.waiting if job in state.packing and job not in decided.nominations]
    jobs = list(packed)
    changes = [NewEvent(PACKING, QUEUE, WaitingJobsPacked(
        packed={job: packed[job] for job in jobs[start:start + PACKED_PER_EVENT]},
        unpacked=unpacked if start == 0 else [])) for start in range(0, len(jobs), PACKED_PER_EVENT)]
    if not changes and unpacked:
        changes.append(NewEvent(PACKING, QUEUE, WaitingJobsPacked(unpacked=unpacked)))
    return changes


def launched(state: AutoscalerState, name: str, provider_id: str) -> list[NewEvent]:
    instance = state.instances.get(name)
    if instance is None or not instance.alive or instance.provider_id == provider_id:
        return []
    return instance_events(name, InstanceLaunched(instance=name, provider_id=provider_id))


def launch_failed(state: AutoscalerState, name: str, reason: str, *, capacity: bool, now: datetime) -> list[NewEvent]:
    """The provider could not start it: the type cools down, longer after each failure in a row, so a type
    without capacity, or one whose instances cannot boot, is not asked for again and again."""
    instance = state.instances.get(name)
    if instance is None or not instance.alive or instance.provider_id is not None:
        return []
    cooldown = state.cooldowns.get(instance.instance_type)
    failures = cooldown.failures if cooldown is not None else 0
    retry_after = now + min(FIRST_COOLDOWN * 2 ** failures, LONGEST_COOLDOWN)
    return instance_events(name, ProvisionFailed(instance=name, instance_type=instance.instance_type, reason=reason,
                                                 capacity=capacity, retry_after=retry_after,
                                                 failures=failures + 1))


def released(state: AutoscalerState, name: str, reason: str, cause: ReleaseCause) -> list[NewEvent]:
    instance = state.instances.get(name)
    if instance is None or not instance.alive:
        return []
    return instance_events(name, InstanceReleased(instance=name, reason=reason, cause=cause))


def overdue(state: AutoscalerState, config: AutoscalerConfig, now: datetime) -> list[Instance]:
    """Instances whose agent has not registered within the boot timeout: they are terminated."""
    limit = timedelta(seconds=config.boot_timeout_seconds)
    return [i for i in state.live.values() if i.on_the_way and now - i.requested_at > limit]


def drains(state: AutoscalerState, config: AutoscalerConfig, now: datetime) -> list[NewEvent]:
    """A3: a ready instance no job has held for its type's idle time is drained first: the scheduler places
    nothing more on it and says so (NodeDrained); only then is it released, if still idle."""
    changes: list[NewEvent] = []
    busy = state.busy_nodes()
    for instance in state.live.values():
        kind = config.instance_type(instance.instance_type)
        since = state.idle_since(instance, busy)
        if instance.alive and instance.draining_since is None and kind is not None and since is not None \
                and now - since >= timedelta(seconds=kind.idle_seconds):
            changes += instance_events(instance.name, InstanceDraining(instance=instance.name, node=instance.name,
                                                                       idle_since=since))
    return changes


def drained(state: AutoscalerState) -> tuple[list[NewEvent], list[Instance]]:
    """What the scheduler's acknowledged drains settle: an instance a job holds after all is kept (the drain
    called off), an idle one is to be released. Every admission to a drained node comes before the
    scheduler's NodeDrained in its log, so having folded that, the autoscaler knows them all: none races
    the release."""
    kept: list[NewEvent] = []
    idle: list[Instance] = []
    busy = state.busy_nodes()
    for instance in state.live.values():
        if not instance.alive or not instance.drained:
            continue
        if instance.name in busy:
            kept += instance_events(instance.name, InstanceKept(instance=instance.name, node=instance.name,
                                                                reason="a job was placed on it before the drain"))
        else:
            idle.append(instance)
    return kept, idle


def registered(state: AutoscalerState, cluster: ClusterConfig, envelope: EventEnvelope) -> list[NewEvent]:
    """An instance is ready once its agent registers with what its type promises (boards included)."""
    event = envelope.event
    if not isinstance(event, NodeRegistered):
        return []
    instance = state.instances.get(event.node.name)
    if instance is None or not instance.on_the_way:
        return []
    kind = cluster.autoscaler.instance_type(instance.instance_type)
    if kind is None or not promised(kind, event.node):
        return []  # not the node its type promises: the boot timeout ends it
    return instance_events(instance.name, InstanceReady(instance=instance.name, node=event.node.name))


def promised(kind: InstanceType, node: NodeInfo) -> bool:
    """The node offers at least the resources of its type, and its boards."""
    boards = {(a.board, a.count) for a in kind.node.accelerators}
    return Resources(cpus=kind.node.cpus, memory_mib=kind.node.memory_mib).fits_in(Resources.of_node(node)) \
        and boards <= {(a.board, a.count) for a in node.accelerators}
