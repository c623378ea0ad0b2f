"""The autoscaler's scale-up as a pure function (SPEC A1, A2, A7): which instances let waiting jobs start.

It asks the scheduler's own placement (libs.placement) rather than counting jobs against idle machines.
First the scheduler's decision on the registered nodes says which waiting jobs start now; what they leave
free, plus the instances already on their way, is the room the others may use. Then each job still
waiting, in start order, is placed at its full size — all its ranks at once, by the same placement and
eligibility rules — on that room, and where it does not fit, on hypothetical instances of a type that serves it,
added one at a time: of the types that can take it, the one that would hold the most of the waiting jobs
per new instance wins, then the one needing fewer, then the first in the config. What is added for one
job is room for the next, so a burst of small jobs shares instances and a gang job gets all its nodes in
one decision. Limits hold per type and in all; a job no type could ever serve is named, not provisioned
for. (Room is counted as if the waiting jobs all started now, not in the order the scheduler's
reservations would start them: the aim is that they all can.)

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
from libs.placement import (
    Admission,
    Capacity,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    choose,
    eligible,
    holdings,
    schedule,
)


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
    # Where each waiting job was packed (job -> node -> what it holds there): the next decision, given them,
    # packs those jobs the same way first, so it sees the room this one left and asks for nothing twice.
    nominations: dict[str, dict[str, Resources]] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)  # the jobs that do not start now and some type serves


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


Nominations = Mapping[str, Mapping[str, Resources]]


def scale_up(demand: Demand, config: AutoscalerConfig, *, on_the_way: Mapping[str, str],
             alive: Mapping[str, int], cooling: Collection[str], suffixes: Sequence[str], now: datetime,
             promised: Mapping[str, Sequence[str]] | None = None, nominated: Nominations | None = None) -> ScaleUp:
    """The instances to ask for now. `on_the_way`: instances requested whose agents have not registered yet
    (name -> type), counted as room; `promised`: the jobs each of them was asked for, which take their room
    there first (as the decision that asked for them packed them), so the next decision sees the same room
    left (after a restart, when the previous decision's `nominated` packing is not known); `alive`: instances
    per type not released (on their way or running), counted against the limits; `cooling`: types not to ask
    for now (their instances failed to start). A new instance is named `<type>-<suffix>` from `suffixes` in
    turn (random ones, from the caller)."""
    coming = [_empty(instance_node(kind, name)) for name, type_name in on_the_way.items()
              if (kind := config.instance_type(type_name)) is not None]
    decision = schedule(demand.queue, list(demand.nodes), dict(demand.flavors), running=demand.running, now=now)
    admitted = {a.job_id: a for a in decision.admissions}
    blocked = [job for job in demand.queue if _blocked(job, admitted.get(job.job_id))]
    unservable = [job.job_id for job in blocked
                  if not any(could_serve(kind, job, demand.flavors) for kind in config.instance_types)]
    room = _Room.left_by(decision, [*demand.nodes, *coming], demand.flavors)
    search = _Search(demand, config, Counter(alive), list(cooling), list(suffixes))
    waiting = [job for job in blocked if job.job_id not in unservable]
    held_for: dict[str, list[str]] = {}
    for name, jobs in (promised or {}).items():
        if name in on_the_way:
            for job_id in jobs:
                held_for.setdefault(job_id, []).append(name)
    packed = {job.job_id for job in waiting if room.take_as_before(job.job_id, (nominated or {}).get(job.job_id))}
    packed |= {job.job_id for job in waiting if job.job_id in held_for and job.job_id not in packed
               and (room.pack(job, demand.flavors, nodes=held_for[job.job_id]) or room.pack(job, demand.flavors))}
    rest = [job for job in waiting if job.job_id not in packed]
    for index, job in enumerate(rest):
        if room.pack(job, demand.flavors) is None:
            search.add_for(job, rest[index:], room)
    requests = [Request(instance=name, instance_type=kind, jobs=room.jobs_on.get(name, []))
                for name, kind in search.added.items() if room.jobs_on.get(name)]
    return ScaleUp(requests=requests, unservable=unservable, nominations=room.held,
                   waiting=[job.job_id for job in waiting])


def _blocked(job: QueuedJob, admitted: Admission | None) -> bool:
    """The job does not start now at its full size."""
    return admitted is None or _workers(admitted.placement) < job.spec.nodes


def _workers(placement: Sequence[Placement]) -> int:
    return sum(1 for p in placement if p.role == "worker")


@dataclass
class _Room:
    """Free resources per node once the scheduler's decision started what it could, and the waiting jobs
    packed since (with the new instances they go on)."""

    nodes: dict[str, NodeCapacity]
    jobs_on: dict[str, list[str]] = field(default_factory=dict)  # node -> the waiting jobs packed on it
    held: dict[str, dict[str, Resources]] = field(default_factory=dict)  # job -> node -> what it holds there

    @classmethod
    def left_by(cls, decision: Decision, nodes: Sequence[NodeCapacity], flavors: Mapping[str, Flavor]) -> _Room:
        room = cls({n.info.name: n for n in nodes})
        for admission in decision.admissions:
            flavor = flavors.get(admission.flavor)
            if flavor is not None:
                for name, held in holdings(admission.placement, flavor).items():
                    room._less(name, held)
        return room

    def _less(self, node: str, amount: Resources) -> None:
        if node in self.nodes:
            self.nodes[node] = NodeCapacity(info=self.nodes[node].info, free=self.nodes[node].free - amount)

    def copy(self) -> _Room:
        return _Room(dict(self.nodes), {name: list(jobs) for name, jobs in self.jobs_on.items()},
                     {job: dict(held) for job, held in self.held.items()})

    def take_as_before(self, job_id: str, held: Mapping[str, Resources] | None) -> bool:
        """Pack a job where the previous decision did, when every node is still there with the room for it."""
        if not held or any(name not in self.nodes or not amount.fits_in(self.nodes[name].free)
                           for name, amount in held.items()):
            return False
        self._take(job_id, held)
        return True

    def _take(self, job_id: str, held: Mapping[str, Resources]) -> None:
        for node, amount in held.items():
            self._less(node, amount)
            self.jobs_on.setdefault(node, []).append(job_id)
        self.held[job_id] = dict(held)

    def with_nodes(self, added: Sequence[NodeCapacity]) -> _Room:
        grown = self.copy()
        grown.nodes.update({n.info.name: n for n in added})
        return grown

    def pack(self, job: QueuedJob, flavors: Mapping[str, Flavor], only: Collection[str] | None = None, *,
             nodes: Collection[str] | None = None) -> str | None:
        """Place `job` at its full size on the room (in one of the flavors `only`, on `nodes` alone, when given)
        and take what it holds; the flavor it got, or None when it does not fit."""
        allowed = {name: f for name, f in flavors.items() if only is None or name in only}
        candidates = [n for name, n in self.nodes.items() if nodes is None or name in nodes]
        choice = choose(Capacity.of(candidates), job.spec, allowed, job.excluded_nodes)
        if choice is None:
            return None
        name, placement = choice
        if _workers(placement) < job.spec.nodes:
            return None  # an elastic job placed smaller: the autoscaler asks for its full size
        self._take(job.job_id, holdings(placement, flavors[name]))
        return name


# How many of the waiting jobs from the one being served on are packed to compare types.
LOOKAHEAD = 32


@dataclass
class _Search:
    demand: Demand
    config: AutoscalerConfig
    used: Counter[str]  # instances per type, alive or added here
    cooling: list[str]
    suffixes: list[str]  # the names left for new instances
    added: dict[str, str] = field(default_factory=dict)  # new instance -> its type

    def add_for(self, job: QueuedJob, waiting: Sequence[QueuedJob], room: _Room) -> None:
        """Add the instances that let `job` start, if the limits allow any: of the types that can take it, the one
        that would hold the most waiting jobs per new instance, then the one needing fewer, then the first."""
        best: tuple[float, int, int] | None = None
        chosen: tuple[InstanceType, list[NodeCapacity]] | None = None
        for order, kind in enumerate(self.config.instance_types):
            if kind.name in self.cooling or not could_serve(kind, job, self.demand.flavors):
                continue
            trial = self._fewest(kind, job, room)
            if trial is None:
                continue
            held = self._held(trial, waiting[:LOOKAHEAD], room)
            score = (-held / len(trial), len(trial), order)
            if best is None or score < best:
                best, chosen = score, (kind, trial)
        if chosen is None:
            return
        kind, nodes = chosen
        room.nodes.update({n.info.name: n for n in nodes})  # packed on the room itself below
        room.pack(job, self.demand.flavors, kind.flavors)
        self.added.update({n.info.name: kind.name for n in nodes})
        self.used[kind.name] += len(nodes)
        del self.suffixes[:len(nodes)]

    def _fewest(self, kind: InstanceType, job: QueuedJob, room: _Room) -> list[NodeCapacity] | None:
        limit = min(job.spec.nodes + job.spec.parameter_servers, kind.max_instances - self.used[kind.name],
                    self.config.max_instances - sum(self.used.values()), len(self.suffixes))
        for count in range(1, limit + 1):
            trial = [_empty(instance_node(kind, f"{kind.name}-{suffix}")) for suffix in self.suffixes[:count]]
            if room.with_nodes(trial).pack(job, self.demand.flavors, kind.flavors) is not None:
                return trial
        return None

    def _held(self, trial: Sequence[NodeCapacity], waiting: Sequence[QueuedJob], room: _Room) -> int:
        """How many of `waiting` the room with `trial` added would hold, packed in turn."""
        grown = room.with_nodes(trial)
        return sum(1 for job in waiting if grown.pack(job, self.demand.flavors) is not None)
