"""The autoscaler's scale-up as a pure function (SPEC A1, A2, A7): which instances let waiting jobs start.

It asks the scheduler's own placement (libs.placement) rather than counting jobs against idle machines:
the cluster as it is, plus the instances already on their way, plus hypothetical instances of each type
that serves a blocked job, added one at a time until that job would start at its full size. Blocked jobs
are taken in start order, and what was added for one counts for the next, so a burst of small jobs
shares instances and a gang job gets all its nodes in one decision. The result is the fewest instances
this greedy search finds, within each type's limit and the global one; a job no type could ever serve is
named once, not provisioned for.

`now` is a parameter and nothing here does I/O, so a decision can be replayed and property-tested.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from libs.contracts.autoscaling import INSTANCE_LABEL, INSTANCE_TYPE_LABEL
from libs.contracts.cluster import AutoscalerConfig, Flavor, InstanceType, NodeInfo, Resources
from libs.contracts.events import Placement
from libs.placement import Decision, NodeCapacity, QueuedJob, RunningJob, eligible, schedule


@dataclass(frozen=True)
class Demand:
    """What the autoscaler sees: the waiting jobs in start order, the nodes that take work with what is free
    on them, and what the running jobs hold."""

    queue: list[QueuedJob]
    nodes: list[NodeCapacity]
    running: list[RunningJob] = field(default_factory=list)
    flavors: Mapping[str, Flavor] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """One instance to ask for, and the waiting jobs that would start on it."""

    instance: str
    instance_type: str
    jobs: list[str]


@dataclass(frozen=True)
class ScaleUp:
    requests: list[Request]
    unservable: list[str]  # waiting jobs that no instance type could ever serve


def instance_node(kind: InstanceType, name: str, address: str = "") -> NodeInfo:
    """The node an instance of `kind` named `name` registers as."""
    labels = {**kind.node.labels, INSTANCE_LABEL: name, INSTANCE_TYPE_LABEL: kind.name}
    return NodeInfo(name=name, address=address, cpus=kind.node.cpus, memory_mib=kind.node.memory_mib,
                    accelerators=list(kind.node.accelerators), pools=list(kind.node.pools), labels=labels)


def _empty(node: NodeInfo) -> NodeCapacity:
    return NodeCapacity(info=node, free=Resources.of_node(node))


def could_serve(kind: InstanceType, job: QueuedJob, flavors: Mapping[str, Flavor]) -> bool:
    """Whether an instance of `kind` could ever hold a rank of `job`: a flavor it serves, that fits it, on a
    node the job may use (pool, boards, driver)."""
    node = instance_node(kind, f"{kind.name}-probe")
    for name in set(job.spec.flavors) & set(kind.flavors):
        flavor = flavors.get(name)
        if flavor is not None and Resources.of_flavor(flavor).fits_in(kind.node.resources) \
                and eligible(node, job.spec, flavor) and not job.spec.node_names:
            return True
    return False


def scale_up(demand: Demand, config: AutoscalerConfig, *, on_the_way: Mapping[str, str],
             alive: Mapping[str, int], cooling: Collection[str], suffixes: Sequence[str],
             now: datetime) -> ScaleUp:
    """The instances to ask for now. `on_the_way`: instances requested whose agents have not registered yet
    (name -> type), counted as capacity; `alive`: instances per type not released (on their way or
    running), counted against the limits; `cooling`: types not to ask for now (a recent capacity error).
    A new instance is named `<type>-<suffix>` from `suffixes` in turn (random ones, from the caller): the
    names placement saw are the names the instances get, so the next decision sees the same cluster."""
    used = Counter(alive)
    room = config.max_instances - sum(used.values())
    coming = [_empty(instance_node(kind, name)) for name, type_name in on_the_way.items()
              if (kind := config.instance_type(type_name)) is not None]
    base = [*demand.nodes, *coming]
    decision = _schedule(demand, base, now)
    unservable = [job.job_id for job in demand.queue if _blocked(job, decision)
                  and not any(could_serve(kind, job, demand.flavors) for kind in config.instance_types)]
    added: list[NodeCapacity] = []
    added_types: dict[str, str] = {}
    for job in demand.queue:
        if room <= 0 or len(added) >= len(suffixes):
            break
        if job.job_id in unservable or not _blocked(job, decision):
            continue
        search = _Search(demand, config, base + added, decision, suffixes[len(added):], now)
        found = search.best_for(job, used, room, cooling)
        if found is None:
            continue
        kind, nodes = found
        added += nodes
        added_types.update({n.info.name: kind.name for n in nodes})
        decision = _schedule(demand, base + added, now)
        # An instance no job would start on once the others are there is not asked for, nor counted.
        added = [node for node in added if _hosted(node, decision)]
        used = Counter(alive) + Counter(added_types[node.info.name] for node in added)
        room = config.max_instances - sum(used.values())
    requests = [Request(instance=node.info.name, instance_type=added_types[node.info.name],
                        jobs=[a.job_id for a in decision.admissions if _on(node, a.placement)]) for node in added]
    return ScaleUp(requests=requests, unservable=unservable)


def _on(node: NodeCapacity, placement: Sequence[Placement]) -> bool:
    return any(p.node == node.info.name for p in placement)


def _hosted(node: NodeCapacity, decision: Decision) -> bool:
    return any(_on(node, a.placement) for a in decision.admissions)


def _schedule(demand: Demand, nodes: Sequence[NodeCapacity], now: datetime) -> Decision:
    return schedule(demand.queue, list(nodes), dict(demand.flavors), running=demand.running, now=now)


def _blocked(job: QueuedJob, decision: Decision) -> bool:
    """The job does not start at its full size on what the decision had."""
    admitted = next((a for a in decision.admissions if a.job_id == job.job_id), None)
    return admitted is None or sum(1 for p in admitted.placement if p.role == "worker") < job.spec.nodes


@dataclass(frozen=True)
class _Search:
    demand: Demand
    config: AutoscalerConfig
    nodes: list[NodeCapacity]  # the cluster so far: registered, on their way, and added in this decision
    decision: Decision  # placement on `nodes`
    suffixes: Sequence[str]  # the names left for new instances
    now: datetime

    def best_for(self, job: QueuedJob, used: Counter[str], room: int,
                 cooling: Collection[str]) -> tuple[InstanceType, list[NodeCapacity]] | None:
        """The type, and how many of it, that let `job` start: the most blocked jobs started per new instance,
        then the fewest instances, then the first type in the config."""
        queued = {j.job_id: j for j in self.demand.queue}
        blocked = {job_id for job_id, j in queued.items() if _blocked(j, self.decision)}
        best: tuple[float, int, int] | None = None
        chosen: tuple[InstanceType, list[NodeCapacity]] | None = None
        for order, kind in enumerate(self.config.instance_types):
            if kind.name in cooling or not could_serve(kind, job, self.demand.flavors):
                continue
            limit = min(job.spec.nodes + job.spec.parameter_servers, kind.max_instances - used[kind.name], room,
                        len(self.suffixes))
            found = self._fewest_of(kind, job, limit)
            if found is None:
                continue
            trial, decision = found
            started = sum(1 for a in decision.admissions if a.job_id in blocked
                          and not _blocked(queued[a.job_id], decision))
            score = (-started / len(trial), len(trial), order)
            if best is None or score < best:
                best, chosen = score, (kind, trial)
        return chosen

    def _fewest_of(self, kind: InstanceType, job: QueuedJob,
                   limit: int) -> tuple[list[NodeCapacity], Decision] | None:
        """The fewest instances of `kind` with which `job` starts, in a flavor `kind` serves, and every job that
        started without them still does (placement packs differently with more nodes)."""
        before = {a.job_id for a in self.decision.admissions}
        for count in range(1, limit + 1):
            trial = [_empty(instance_node(kind, f"{kind.name}-{suffix}")) for suffix in self.suffixes[:count]]
            decision = _schedule(self.demand, self.nodes + trial, self.now)
            admitted = next((a for a in decision.admissions if a.job_id == job.job_id), None)
            if admitted is not None and not _blocked(job, decision) and admitted.flavor in kind.flavors \
                    and before <= {a.job_id for a in decision.admissions}:
                return trial, decision
        return None
