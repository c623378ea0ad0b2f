"""One scheduling cycle as a pure function: a snapshot in, a decision out (SPEC S1, S4, S5, S9, S10).

The cycle walks the queue in start order. Each job tries its flavors in the order given (S5) and
places every rank at once or none (S4), on the nodes it may use (S9); an elastic job may start on
fewer nodes (S10). The first job that cannot start becomes the head: it gets a reservation (the
earliest time its gang fits, from the duration limits of running jobs), and a later job starts now
only if it cannot delay that reservation (backfill). Jobs that fit on no node even of an empty
cluster are reported and never block anyone. Last, shrunken elastic jobs are grown on what is left.

Nothing here reads a clock or does I/O: `now` is a parameter, so a decision can be replayed. The
scheduler decides with it; the autoscaler asks it what instances would let waiting jobs start.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
import math
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Flavor, NodeInfo, Resources
from libs.contracts.events import Placement, Role
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec


@dataclass(frozen=True)
class NodeCapacity:
    """A schedulable node and what is free on it now."""

    info: NodeInfo
    free: Resources


NO_NODES: frozenset[str] = frozenset()
_MICROSECOND = timedelta(microseconds=1)
# A cycle decides on the first this many waiting jobs, as Slurm's scheduler looks `default_queue_depth` deep:
# they are more than enough to fill the cluster, and a queue of tens of thousands costs a cycle no more. The
# jobs behind them move up as these start (predictions still plan the whole queue).
CYCLE_DEPTH = 2_000


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    spec: JobSpec
    duration_seconds: int | None = None  # its current duration limit (J16/S11); None = no limit
    excluded_nodes: frozenset[str] = NO_NODES  # nodes it was moved away from (M6): never placed there
    # D1 locality: bytes of its datasets each node's cache holds; of the nodes a rank fits on, those holding
    # more come first (where the job goes, never whether it starts: the queue's order and reservations stand).
    prefer: Mapping[str, int] = field(default_factory=dict)
    # `job_shape` of it, worked out once: a job waits through many cycles, and each looks at it.
    shape: Shape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", job_shape(self.spec, self.excluded_nodes))

    def lasting(self, seconds: int | None) -> QueuedJob:
        """A copy that runs for `seconds` (as a plan takes it)."""
        return QueuedJob(self.job_id, self.spec, seconds, self.excluded_nodes, self.prefer)


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    spec: JobSpec
    flavor: Flavor
    placement: list[Placement]
    ends_at: datetime | None  # started_at + duration limit; None = no limit (unknown end)
    can_grow: bool = True  # False while it is already being moved
    excluded_nodes: frozenset[str] = NO_NODES  # a growth never lands there either

    @cached_property
    def held(self) -> Mapping[str, Resources]:
        """What it holds on each node (`holdings`), worked out once: a job runs through many cycles."""
        return holdings(self.placement, self.flavor)

    def changed(self, **changes: Any) -> RunningJob:
        """A copy with another end or growth flag (`ends_at`, `can_grow`), keeping what it holds as worked out
        already: that depends only on its placement and flavor, which do not change."""
        assert not changes.keys() & {"placement", "flavor"}
        twin = replace(self, **changes)
        if "held" in self.__dict__:
            twin.__dict__["held"] = self.__dict__["held"]  # where cached_property keeps it
        return twin


@dataclass(frozen=True)
class RunningChange:
    """How a list of running jobs differs from the list given to the last cycle over the same `Cluster` (`before`, the
    very object): the jobs of that list not in this one and those of this one not in that, by identity. Whoever keeps
    the list as jobs start and end knows it at once; a cycle told so compares no lists (`schedule`)."""

    before: Sequence[RunningJob]
    gone: Sequence[RunningJob]
    added: Sequence[RunningJob]


@dataclass(frozen=True)
class Admission:
    job_id: str
    flavor: str
    placement: list[Placement]
    dropped_flavors: list[str] = field(default_factory=list)  # S5: the job's other flavors
    backfilled: bool = False  # started ahead of a blocked job


@dataclass(frozen=True)
class Growth:
    """S10: restart a running elastic job on a bigger placement."""

    job_id: str
    flavor: str
    placement: list[Placement]


@dataclass(frozen=True)
class Reservation:
    """What the first blocked job (the "head") is promised."""

    job_id: str
    flavor: str
    start: datetime | None  # None: unknown (it waits on running jobs without a duration limit)
    nodes: list[str]  # one per rank


@dataclass(frozen=True)
class Decision:
    admissions: list[Admission]
    growths: list[Growth]
    reservation: Reservation | None
    unplaceable: list[str]  # queued jobs that fit on no node of this cluster even when it is empty


# --- eligibility and single-gang placement ------------------------------------------------------------


def eligible(node: NodeInfo, spec: JobSpec, flavor: Flavor, exclude: Collection[str] = NO_NODES) -> bool:
    """S9: pinning, driver version and dedicated pools decide which nodes a job may use; a job moved
    away from a node (`exclude`) never goes back to it."""
    if node.name in exclude:
        return False
    if spec.node_names and node.name not in spec.node_names:
        return False
    # Nodes of a dedicated pool serve only jobs that ask for that pool.
    if spec.pool is not None:
        if spec.pool not in node.pools:
            return False
    elif node.pools:
        return False
    if flavor.accelerators:
        if flavor.board is not None and node.board != flavor.board:
            return False
        if spec.driver_version is not None and node.driver_version != spec.driver_version:
            return False
    return True


@dataclass(frozen=True)
class Served:
    """Which jobs some node could take at all, by pinning and pool alone (S9): a cycle passes over the others
    without counting them against `CYCLE_DEPTH`, so that thousands of jobs waiting for a pool no node serves (yet)
    never keep out the jobs behind them that could start."""

    names: frozenset[str]
    pools: frozenset[str]
    general: bool  # some node is of no dedicated pool

    @classmethod
    def by(cls, nodes: Iterable[NodeInfo]) -> Served:
        listed = list(nodes)
        return cls(names=frozenset(node.name for node in listed),
                   pools=frozenset(pool for node in listed for pool in node.pools),
                   general=any(not node.pools for node in listed))

    def may_serve(self, spec: JobSpec) -> bool:
        if spec.node_names and self.names.isdisjoint(spec.node_names):
            return False
        return spec.pool in self.pools if spec.pool is not None else self.general


def role_flavor(role: str, flavor: Flavor) -> Flavor:
    """What one rank of `role` holds: the job's flavor, or the fixed parameter-server flavor (J8)."""
    return PARAMETER_SERVER_FLAVOR if role == "ps" else flavor


def parameter_server_count(spec: JobSpec) -> int:
    return spec.parameter_servers if spec.mode == "tensorflow" else 0


def worker_counts(spec: JobSpec) -> range:
    """The worker counts a job accepts, most preferred first: its node count, then (S10, elastic)
    every smaller count down to its minimum."""
    elastic = spec.checkpoint_resume.elastic if spec.checkpoint_resume else None
    # A job that does not allow scaling down waits for its full size.
    lowest = min(elastic.min_nodes, spec.nodes) if elastic and elastic.allow_scale_down else spec.nodes
    return range(spec.nodes, lowest - 1, -1)


def holdings(placement: Iterable[Placement], flavor: Flavor) -> dict[str, Resources]:
    """What a placement holds on each node."""
    held: dict[str, Resources] = {}
    for placed in placement:
        need = Resources.of_flavor(role_flavor(placed.role, flavor))
        held[placed.node] = held[placed.node] + need if placed.node in held else need
    return held


def least(a: Resources, b: Resources) -> Resources:
    return Resources(cpus=min(a.cpus, b.cpus), memory_mib=min(a.memory_mib, b.memory_mib),
                     accelerators=min(a.accelerators, b.accelerators))


_EligibilityKey = tuple[tuple[str, ...], str | None, tuple[str | None, str | None] | None, frozenset[str]]


def _eligibility_key(spec: JobSpec, flavor: Flavor, exclude: frozenset[str]) -> _EligibilityKey:
    """Everything `eligible` looks at, so nodes are filtered once per kind of rank and cycle."""
    accelerators = (flavor.board, spec.driver_version) if flavor.accelerators else None
    return tuple(spec.node_names), spec.pool, accelerators, exclude


class Cluster:
    """The nodes of one cycle, with the eligible nodes of each kind of rank computed once."""

    def __init__(self, infos: Iterable[NodeInfo]) -> None:
        self.infos: dict[str, NodeInfo] = {info.name: info for info in infos}
        self._eligible: dict[_EligibilityKey, tuple[str, ...]] = {}
        self._eligible_sets: dict[_EligibilityKey, frozenset[str]] = {}
        self._totals: dict[str, Resources] | None = None
        # Kept for the cycles over these nodes (with one set of flavors): see `Cycle`.
        self.placeable: dict[Shape, bool] = {}
        self.most_workers: dict[tuple[_EligibilityKey, Resources], int] = {}
        # What `schedule` keeps from one cycle to the next over these nodes (`_Kept`); a cycle takes it while it runs.
        self.kept: _Kept | None = None

    @cached_property
    def served(self) -> Served:
        """Which jobs some of these nodes could take at all, by pool and pinning (`Served`)."""
        return Served.by(self.infos.values())

    @property
    def totals(self) -> dict[str, Resources]:
        """Each node's resources, as if it were empty."""
        if self._totals is None:
            self._totals = {name: Resources.of_node(info) for name, info in self.infos.items()}
        return self._totals

    def eligible(self, spec: JobSpec, flavor: Flavor,
                 exclude: frozenset[str] = NO_NODES) -> tuple[_EligibilityKey, tuple[str, ...]]:
        key = _eligibility_key(spec, flavor, exclude)
        names = self._eligible.get(key)
        if names is None:
            names = tuple(name for name, info in self.infos.items() if eligible(info, spec, flavor, exclude))
            self._eligible[key] = names
        return key, names

    def eligible_set(self, key: _EligibilityKey) -> frozenset[str]:
        """The names `eligible` gave for `key`, as a set."""
        names = self._eligible_sets.get(key)
        if names is None:
            names = self._eligible_sets[key] = frozenset(self._eligible[key])
        return names


class _Fitting:
    """The nodes where one rank needing `need` fits now, and (once a placement asked for it) a heap of
    them roomiest first. The heap is kept lazily: nodes whose room changed are noted, and pushed again
    with their new room when the heap is next read; entries that no longer match a node's room are
    dropped when they surface."""

    __slots__ = ("changed", "eligible", "heap", "names", "need", "nodes", "room")

    def __init__(self, need: Resources, names: tuple[str, ...], eligible: frozenset[str]) -> None:
        self.need = need
        self.names = names  # the nodes eligible
        self.eligible = eligible  # the same, as a set
        self.nodes: set[str] = set()
        # How many such ranks the eligible nodes hold room for in all (`_room`): ranks all alike fit exactly when
        # there is room for that many, so a gang that does not fit is known without trying to place it.
        self.room = 0
        self.heap: list[tuple[float, int, str]] | None = None
        self.changed: set[str] = set()


class Capacity:
    """Free resources per node, with an index of the nodes where one rank of a kind fits.

    On a busy cluster only a few nodes have room; the index lets a placement look at those instead
    of every node, and it is kept up to date as resources are taken and given back.

    A capacity made `over` another one is that one but for a few nodes (what a backfill may use, or what is free
    at some later instant): its indexes are copied from the other's and corrected on those nodes only, rather than
    worked out over every eligible node. Until it is dropped, the other one may change only on nodes set on it too.
    """

    def __init__(self, cluster: Cluster, free: dict[str, Resources]) -> None:
        self.cluster = cluster
        self.free = free
        self._fitting: dict[tuple[_EligibilityKey, Resources], _Fitting] = {}
        self._shaped: dict[Shape, list[_Fitting | None]] = {}  # a job shape's index of each flavor (`rooms`)
        # Per node, the indexes that list it: worked out when it first changes, and again once an index was added.
        self._watchers: dict[str, list[_Fitting]] = {}
        self._base: Capacity | None = None
        self._own: set[str] = set()  # with a base: the nodes whose room may differ from the base's
        self.revision = 0  # moves on with every change of a node's room
        self.touched: set[str] | None = None  # when a set: the nodes whose room changed since it was last emptied
        # The nodes it was made from or last brought up to date with (`update`), where each is in that list, and the
        # nodes whose room was set since.
        self.given: list[NodeCapacity] | None = None
        self._positions: dict[str, int] = {}
        self._set_since: set[str] = set()

    @classmethod
    def of(cls, nodes: Iterable[NodeCapacity]) -> Capacity:
        nodes = list(nodes)
        return cls(Cluster(n.info for n in nodes), {n.info.name: n.free for n in nodes})

    @classmethod
    def over(cls, base: Capacity, changes: Mapping[str, Resources] | None = None) -> Capacity:
        """`base`, but for `changes` (and whatever is `set` on it later)."""
        twin = cls(base.cluster, dict(base.free))
        twin._base = base
        for name, free in (changes or {}).items():
            twin.free[name] = free
            twin._own.add(name)
        return twin

    def copy(self) -> Capacity:
        return Capacity(self.cluster, dict(self.free))

    def fitting(self, spec: JobSpec, flavor: Flavor, exclude: frozenset[str] = NO_NODES) -> set[str]:
        """Nodes eligible for one rank of `flavor` where one such rank fits now (a live view)."""
        return self._index(spec, flavor, exclude).nodes

    def _index(self, spec: JobSpec, flavor: Flavor, exclude: frozenset[str]) -> _Fitting:
        key, names = self.cluster.eligible(spec, flavor, exclude)
        need = Resources.of_flavor(flavor)
        index = self._fitting.get((key, need))
        if index is None:
            index = self._fitting[(key, need)] = _Fitting(need, names, self.cluster.eligible_set(key))
            free, fits = self.free, need.fits_in
            if self._base is not None:
                based = self._base._index(spec, flavor, exclude)
                index.nodes, index.room = set(based.nodes), based.room + self._room_beside_base(index)
                for name in self._own & index.eligible:
                    if fits(free[name]):
                        index.nodes.add(name)
                    else:
                        index.nodes.discard(name)
            else:
                index.nodes = {name for name in names if fits(free[name])}
                index.room = sum(_room(need, free[name]) for name in index.nodes)
            self._watchers.clear()
        return index

    def rooms(self, shape: Shape, spec: JobSpec, flavors: Mapping[str, Flavor], exclude: frozenset[str],
              ) -> list[int] | None:
        """For a job of `shape` whose ranks are all alike: how many ranks of each of its flavors there is room for
        (by `spec.flavors`' order; 0 for a flavor the cluster lacks). None for a job with parameter servers."""
        base = self._base
        if base is not None:  # the base's, corrected on the few nodes where this one differs: no index made here
            rooms = base.rooms(shape, spec, flavors, exclude)
            if rooms is None or not self._own:
                return rooms
            for place, index in enumerate(base._shaped[shape]):
                if index is not None:
                    rooms[place] += self._room_beside_base(index)
            return rooms
        indexes = self._shaped.get(shape)
        if indexes is None:
            if parameter_server_count(spec):
                return None
            indexes = self._shaped[shape] = [
                None if (flavor := flavors.get(name)) is None else self._index(spec, flavor, exclude)
                for name in spec.flavors]
        return [0 if index is None else index.room for index in indexes]

    def _room_beside_base(self, index: _Fitting) -> int:
        """How much more room than its base this capacity has for the ranks of `index` (of its base or its own): the
        difference on the nodes set here."""
        assert self._base is not None
        need, free, base_free = index.need, self.free, self._base.free
        return sum(_room(need, free[name]) - _room(need, base_free[name]) for name in self._own & index.eligible)

    def roomiest(self, index: _Fitting, count: int) -> list[str]:
        """The `count` nodes of `index` with the most free CPU, then memory (ties by name), in that
        order; `index` holds at least `count` nodes."""
        free = self.free
        heap = index.heap
        if heap is None or len(heap) + len(index.changed) > 2 * len(index.nodes) + 64:  # mostly stale
            heap = index.heap = [(-free[name].cpus, -free[name].memory_mib, name) for name in index.nodes]
            heapq.heapify(heap)
        else:
            for name in index.changed:
                if name in index.nodes:
                    heapq.heappush(heap, (-free[name].cpus, -free[name].memory_mib, name))
        index.changed.clear()
        chosen: list[tuple[float, int, str]] = []
        names: set[str] = set()
        while len(chosen) < count:
            entry = heapq.heappop(heap)
            name = entry[2]
            room = free[name]
            # A stale entry: the node's current room has an entry of its own (or it no longer fits).
            if name in names or name not in index.nodes or entry[0] != -room.cpus or entry[1] != -room.memory_mib:
                continue
            chosen.append(entry)
            names.add(name)
        for entry in chosen:
            heapq.heappush(heap, entry)
        return [entry[2] for entry in chosen]

    def set(self, name: str, free: Resources) -> None:
        old = self.free[name]
        self.free[name] = free
        self.revision += 1
        if self.touched is not None:
            self.touched.add(name)
        self._set_since.add(name)
        if self._base is not None:
            self._own.add(name)
        watchers = self._watchers.get(name)
        if watchers is None:
            watchers = self._watchers[name] = [index for index in self._fitting.values() if name in index.eligible]
        for index in watchers:
            need, nodes = index.need, index.nodes
            fits = need.fits_in(free)
            index.room += _room(need, free, fits) - _room(need, old, name in nodes)  # (listed there: one fitted)
            if fits:
                nodes.add(name)
                if index.heap is not None:
                    index.changed.add(name)
            else:
                nodes.discard(name)

    def update(self, nodes: list[NodeCapacity]) -> bool:
        """Bring it up to date with what is free on `nodes` (the same nodes); False when they are not the same.

        Given the same nodes in the same order as last time (`given`), only those that are not the very objects given
        at the same place are looked at, and those whose room was set here since (a cycle's admissions): the scheduler
        gives the same object for a node where nothing changed."""
        free, given = self.free, self.given
        if given is not None and len(given) == len(nodes):
            for place in itertools.compress(range(len(nodes)), map(operator.is_not, nodes, given)):
                node = nodes[place]
                name = node.info.name
                if name != given[place].info.name:
                    break  # another node there: every node is looked at
                if free[name] != node.free:
                    self.set(name, node.free)
            else:
                for name in list(self._set_since):
                    node = nodes[self._positions[name]]
                    if free[name] != node.free:
                        self.set(name, node.free)
                self.given = list(nodes)  # (a copy: the caller may change its list)
                self._set_since.clear()
                return True
        count = 0
        for node in nodes:
            name = node.info.name
            count += 1
            now = free.get(name)
            if now is None:
                return False
            if now != node.free:
                self.set(name, node.free)
        if count != len(free):
            return False
        self.remember(nodes)
        return True

    def remember(self, nodes: list[NodeCapacity]) -> None:
        """That its room is what `nodes` say (for the next `update`)."""
        self.given = list(nodes)  # (a copy: the caller may change its list)
        self._positions = {node.info.name: place for place, node in enumerate(nodes)}
        self._set_since.clear()

    def take(self, held: Mapping[str, Resources]) -> None:
        for name, amount in held.items():
            if name in self.free:
                self.set(name, self.free[name] - amount)

    def give(self, held: Mapping[str, Resources]) -> None:
        for name, amount in held.items():
            if name in self.free:
                self.set(name, self.free[name] + amount)


def place(capacity: Capacity, spec: JobSpec, flavor: Flavor, workers: int,
          exclude: frozenset[str] = NO_NODES, prefer: Mapping[str, int] | None = None) -> list[Placement] | None:
    """Place `workers` workers of `flavor` and the job's parameter servers on `capacity`, all or none,
    never on a node of `exclude`.

    Each rank goes to the eligible node holding the fewest ranks of this job so far, then holding the
    most of the job's data in its cache (`prefer`, bytes per node; D1 locality), then with the most free
    CPU left, then memory (ties by name), which spreads a job across hosts when it can and packs it when it
    must. Ranks all alike take a node each fits on whatever the order, so locality changes where they go,
    never whether they all fit; it is not used for a job with parameter servers, whose ranks are not alike.
    `capacity` itself is not changed.
    """
    local = {name: size for name, size in (prefer or {}).items() if size > 0} if not parameter_server_count(spec) \
        else {}
    worker_roles: list[Role] = ["worker"] * workers
    server_roles: list[Role] = ["ps"] * parameter_server_count(spec)
    roles = worker_roles + server_roles
    indexes = {role: capacity._index(spec, role_flavor(role, flavor), exclude) for role in dict.fromkeys(roles)}
    if not server_roles and indexes["worker"].room < workers:
        return None  # ranks all alike: not room for that many, wherever they went
    if not local and workers and len(indexes["worker"].nodes) >= workers and (
            not server_roles or len(indexes["ps"].nodes) >= len(roles)):
        return _spread(capacity, indexes, worker_roles, server_roles, flavor)
    free = capacity.free
    # One heap of candidate nodes per role, ordered by the rule above. A node's key only grows as
    # ranks land on it, so an outdated entry is simply re-queued with its current key when it surfaces.
    heaps: dict[Role, list[tuple[int, int, float, int, str]]] = {}
    for role, index in indexes.items():
        nodes = index.nodes
        if not nodes:
            return None
        heaps[role] = [(0, -local.get(name, 0), -free[name].cpus, -free[name].memory_mib, name) for name in nodes]
        heapq.heapify(heaps[role])
    infos = capacity.cluster.infos
    left: dict[str, Resources] = {}  # free after the ranks placed so far, for the nodes used
    ranks_on: dict[str, int] = {}
    placement: list[Placement] = []
    for rank, role in enumerate(roles):
        rank_flavor = role_flavor(role, flavor)
        need = Resources.of_flavor(rank_flavor)
        heap = heaps[role]
        while heap:
            entry = heapq.heappop(heap)
            name = entry[4]
            room = left.get(name, free[name])
            if not need.fits_in(room):
                continue  # room only shrinks while this job is placed
            current = (ranks_on.get(name, 0), -local.get(name, 0), -room.cpus, -room.memory_mib, name)
            if current == entry:
                break
            heapq.heappush(heap, current)
        else:
            return None
        room = left[name] = room - need
        ranks_on[name] = ranks_on.get(name, 0) + 1
        heapq.heappush(heap, (ranks_on[name], -local.get(name, 0), -room.cpus, -room.memory_mib, name))
        placement.append(Placement(rank=rank, node=name, address=infos[name].address, slots=rank_flavor.slots,
                                   role=role))
    return placement


def _spread(capacity: Capacity, indexes: Mapping[Role, _Fitting], workers: list[Role], servers: list[Role],
            flavor: Flavor) -> list[Placement]:
    """What `place` decides when a worker fits on at least as many nodes as there are workers, and a
    parameter server on at least as many as there are ranks: a node without a rank of the job always
    beats one with, so every rank lands on a node of its own, the roomiest one left, and only the
    roomiest few nodes need to be looked at."""
    hosts = capacity.roomiest(indexes["worker"], len(workers))
    if servers:
        used = set(hosts)
        hosts += [name for name in capacity.roomiest(indexes["ps"], len(workers) + len(servers))
                  if name not in used][:len(servers)]
    infos = capacity.cluster.infos
    return [Placement(rank=rank, node=name, address=infos[name].address, slots=role_flavor(role, flavor).slots,
                      role=role)
            for rank, (role, name) in enumerate(zip([*workers, *servers], hosts, strict=True))]


def place_gang(spec: JobSpec, flavor: Flavor, nodes: Iterable[NodeCapacity], *,
               node_count: int | None = None) -> list[Placement] | None:
    """Place all ranks of a job, or return None: `node_count` (default `spec.nodes`) workers of
    `flavor`, then (TensorFlow) `spec.parameter_servers` parameter servers of the fixed flavor."""
    return place(Capacity.of(nodes), spec, flavor, spec.nodes if node_count is None else node_count)


Choice = tuple[str, list[Placement]]  # a flavor name and a placement


def choose(capacity: Capacity, spec: JobSpec, flavors: Mapping[str, Flavor],
           exclude: frozenset[str] = NO_NODES, prefer: Mapping[str, int] | None = None, *,
           shape: Shape | None = None) -> Choice | None:
    """The job's first workable (flavor, placement): every flavor at the full node count first, then
    (elastic jobs) every flavor at each smaller count. Flavors are equivalent (J9) but node counts
    are not: a shrunken job runs slower and must be restarted to grow, so size comes first.

    With the job's `shape`, a gang of ranks all alike that there is not room for is passed over on the room its
    indexes count (`_Fitting.room`), found by shape, with no placement tried: most jobs a cycle looks at do not fit."""
    rooms = capacity.rooms(shape, spec, flavors, exclude) if shape is not None else None
    for count in worker_counts(spec):
        for index, name in enumerate(spec.flavors):
            flavor = flavors.get(name)
            if flavor is None or (rooms is not None and rooms[index] < count):
                continue
            placement = place(capacity, spec, flavor, count, exclude, prefer)
            if placement is not None:
                return name, placement
    return None


Shape = tuple[object, ...]


def job_shape(spec: JobSpec, exclude: frozenset[str] = NO_NODES) -> Shape:
    """What placement depends on: two jobs of one shape fit or fail alike on the same capacity."""
    return (tuple(spec.flavors), spec.nodes, worker_counts(spec)[-1], spec.pool,
            spec.driver_version, tuple(spec.node_names), parameter_server_count(spec), exclude)


def _slots(need: Resources, free: Resources) -> int:
    """How many ranks needing `need` fit in `free`."""
    count = math.floor(free.cpus / need.cpus + 1e-9)
    if need.memory_mib and free.memory_mib // need.memory_mib < count:
        count = free.memory_mib // need.memory_mib
    if need.accelerators and free.accelerators // need.accelerators < count:
        count = free.accelerators // need.accelerators
    return count if count > 0 else 0


def _room(need: Resources, free: Resources, fits: bool | None = None) -> int:
    """How many ranks needing `need` fit in `free` as `place` puts them: none where one does not fit (`fits_in`: room
    short of nothing, say, but of accelerators a node has fewer of than none), at least one where it does. `fits`:
    whether one does, when that is known already."""
    if not (need.fits_in(free) if fits is None else fits):
        return 0
    count = _slots(need, free)
    return count if count > 0 else 1


# --- the cycle ------------------------------------------------------------------------------------------


def schedule(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
             running: Sequence[RunningJob] = (), now: datetime, cluster: Cluster | None = None,
             running_change: RunningChange | None = None) -> Decision:
    """Decide which queued jobs start now and which running elastic jobs grow.

    `queue` is in start order (S1); `nodes` are the schedulable nodes with what is free on them now;
    `running` says what the running jobs hold and until when (their duration limits). `cluster`, when
    given, is the `Cluster` of the same nodes from an earlier cycle: what it worked out about them is reused, and so is
    what the last cycle over it kept (`_Kept`): only what changed since is worked out again. `running_change`, when
    given, says how `running` differs from the list the last cycle over `cluster` was given (else the two are compared
    job by job).
    """
    cycle = Cycle(nodes, flavors, running, now, cluster=cluster, keep=cluster is not None,
                  running_change=running_change)
    decision = cycle.run(queue)
    if cluster is not None:
        cluster.kept = _Kept(cycle.free_now, cycle.held, cycle.free_now.revision, cycle.failed_now, cycle.extra_made,
                             cycle.failed_extra, cycle.releases, running)
    return decision


# The release order: jobs release what they hold in order of end, ties by id. Each node's amounts are summed in this
# order wherever they are summed, so that what is free at an instant is the same to the last bit however it was
# worked out.
_BY_ID, _BY_END = operator.attrgetter("job_id"), operator.attrgetter("ends_at")
# Past this many jobs started or ended since the last cycle, what they hold is worked out afresh rather than from it.
CHANGED_AT_MOST = 64


class _Held:
    """What running jobs hold and until when, worked out once for a list of them: the jobs with a known end in order
    of end (the release order), what those hold, what the others hold, and which jobs may grow. For a list that differs
    from an earlier one by a few jobs that ended or started, `then` works it out from the earlier one and says which
    (`gone`, `added`)."""

    def __init__(self, running: list[RunningJob]) -> None:
        self.running = running
        self._by_id: dict[int, RunningJob] | None = None
        # In the release order: by id, then by end (a sort keeps the order of ties), cheaper than by both at once.
        self.jobs: list[RunningJob] = sorted((job for job in running if job.ends_at is not None), key=_BY_ID)
        self.jobs.sort(key=_BY_END)
        self.ends: list[datetime] = [job.ends_at for job in self.jobs]  # type: ignore[misc]
        self.timed: list[Mapping[str, Resources]] = [job.held for job in self.jobs]
        self.distinct: list[datetime] = list(dict.fromkeys(self.ends))  # (sorted already)
        # Growth goes by priority, then in the list's order.
        self.growable: list[RunningJob] = sorted((job for job in running if may_grow(job)),
                                                 key=lambda job: PRIORITY_RANK[job.spec.priority])
        # Since the one this was worked out from (`then`); None: worked out afresh.
        self.gone: list[RunningJob] | None = None
        self.added: list[RunningJob] = []

    @property
    def untimed(self) -> list[Mapping[str, Resources]]:
        return [job.held for job in self.running if job.ends_at is None]

    @property
    def by_id(self) -> dict[int, RunningJob]:
        """The running jobs by identity (worked out when first asked: only a kept cycle's `then` asks)."""
        if self._by_id is None:
            self._by_id = dict(zip(map(id, self.running), self.running, strict=True))
        return self._by_id

    def then(self, running: list[RunningJob]) -> _Held:
        """The same for `running`: from this one when few jobs differ."""
        by_id, before = dict(zip(map(id, running), running, strict=True)), self.by_id
        gone_ids = before.keys() - by_id.keys()
        added_ids = by_id.keys() - before.keys()
        if len(by_id) != len(running):  # a job listed twice: worked out afresh (`changed` counts the rest)
            return _Held(running)
        twin = self.changed(running, [before[key] for key in gone_ids], [by_id[key] for key in added_ids])
        twin._by_id = by_id
        return twin

    def changed(self, running: list[RunningJob], gone: Sequence[RunningJob], added: Sequence[RunningJob]) -> _Held:
        """The same for `running`, which holds this one's jobs but `gone` and besides them `added` (by identity)."""
        if len(gone) + len(added) > CHANGED_AT_MOST:
            return _Held(running)
        twin = copy.copy(self)
        twin.running, twin._by_id = running, None
        twin.jobs, twin.ends, twin.timed, twin.distinct = (list(self.jobs), list(self.ends), list(self.timed),
                                                           list(self.distinct))
        twin.gone, twin.added = list(gone), list(added)
        for job in twin.gone:
            gone_end = job.ends_at
            if gone_end is None:
                continue
            place, high = bisect.bisect_left(twin.ends, gone_end), bisect.bisect_right(twin.ends, gone_end)
            while place < high and twin.jobs[place] is not job:  # among those ending then
                place += 1
            if place == high:  # not one of these jobs: worked out afresh rather than wrongly
                return _Held(running)
            del twin.jobs[place], twin.ends[place], twin.timed[place]
            if gone_end not in twin.ends[max(place - 1, 0):place + 1]:  # no other job ends then
                twin.distinct.pop(bisect.bisect_left(twin.distinct, gone_end))
        for job in twin.added:
            end = job.ends_at
            if end is None:
                continue
            place, high = bisect.bisect_left(twin.ends, end), bisect.bisect_right(twin.ends, end)
            while place < high and twin.jobs[place].job_id < job.job_id:  # among those ending then, by id
                place += 1
            twin.jobs.insert(place, job)
            twin.ends.insert(place, end)
            twin.timed.insert(place, job.held)
            index = bisect.bisect_left(twin.distinct, end)
            if index == len(twin.distinct) or twin.distinct[index] != end:
                twin.distinct.insert(index, end)
        gone_ids = set(map(id, twin.gone))
        arrived = [job for job in twin.added if may_grow(job)]
        if arrived:  # where it goes among the others depends on the list's order
            positions = dict(zip(map(id, running), range(len(running)), strict=True))
            growable = [job for job in self.growable if id(job) not in gone_ids] + arrived
            twin.growable = sorted(growable, key=lambda job: (PRIORITY_RANK[job.spec.priority], positions[id(job)]))
        elif gone_ids:
            twin.growable = [job for job in self.growable if id(job) not in gone_ids]
        return twin


@dataclass
class _Kept:
    """What one cycle over a `Cluster` leaves the next (see `schedule`): its capacity, brought up to date with what is
    free by the next on the nodes that changed (its indexes with it), and what its running jobs hold (`_Held`), used
    again while they are the same."""

    capacity: Capacity
    held: _Held | None
    # The job shapes that did not fit what was free now, nor what a backfill could use (`extra`, made as `extra_made`
    # says), which stay so while neither changed: the capacity's revision is the same when the next cycle begins.
    revision: int = -1
    failed_now: set[Shape] = field(default_factory=set)
    extra_made: tuple[object, ...] | None = None
    failed_extra: set[Shape] = field(default_factory=set)
    releases: _Releases | None = None  # kept over `capacity`, following `held`
    given: Sequence[RunningJob] | None = None  # the running jobs as given (the very list: see `RunningChange`)


@dataclass
class _Head:
    reservation: Reservation
    at_start: dict[str, Resources]  # free at the reserved start, before the head takes its share
    held: dict[str, Resources]  # what the head's reserved placement holds per node


class _Timeline:
    """One capacity moved to each instant a reservation search asks about: what is free once the first releases
    (sorted by end) have happened. Each node's amounts are summed in the order `Cycle._capacity_after` sums them,
    and only as far as the search goes, so the capacity at an instant is the same as one made for it, and its index
    is kept up to date rather than built for every instant the search looks at."""

    def __init__(self, free_now: Capacity, timed: Sequence[Mapping[str, Resources]]) -> None:
        self.base = free_now.free
        self.capacity = Capacity.over(free_now)
        self.timed = timed
        self.after: dict[str, list[Resources]] = {}  # per node: what is free after none, one, two... of its releases
        self.steps: list[list[tuple[str, int]]] = []  # per release summed: its nodes, and how many of theirs it ends
        self.applied = 0

    def at(self, count: int) -> Capacity:
        """The capacity once the first `count` releases have happened (valid until the next call)."""
        capacity, after, steps = self.capacity, self.after, self.steps
        while self.applied < count:
            if self.applied == len(steps):
                steps.append(self._summed(self.timed[self.applied]))
            for name, index in steps[self.applied]:
                capacity.set(name, after[name][index])
            self.applied += 1
        while self.applied > count:
            self.applied -= 1
            for name, index in steps[self.applied]:
                capacity.set(name, after[name][index - 1])
        return capacity

    def _summed(self, held: Mapping[str, Resources]) -> list[tuple[str, int]]:
        step = []
        for name, amount in held.items():
            if name in self.base:
                amounts = self.after.setdefault(name, [self.base[name]])
                amounts.append(amounts[-1] + amount)
                step.append((name, len(amounts) - 1))
        return step


class _Counted:
    """The reservation search for a job whose ranks are all alike (no parameter servers), by counting: such ranks fit
    wherever there is room for them, in any order (`place`), so they fit at an instant exactly when the eligible nodes
    hold that many ranks' room then. The releases are summed node by node up to the first instant at which they do,
    and only there (and just before) is a placement made, to check the count and to place the head: far cheaper than
    moving a whole capacity, its indexes with it, back and forth across the releases as a search over instants does.
    The free amounts are summed in the order `_Timeline` sums them, so the capacity at the instant is the same."""

    def __init__(self, cycle: Cycle, ends: Sequence[datetime], timed: Sequence[Mapping[str, Resources]],
                 times: Sequence[datetime]) -> None:
        self.cycle, self.ends, self.timed, self.times = cycle, ends, timed, times
        # Per release summed so far (shared by the flavors and node counts tried): each node it frees room on, with
        # what is free there before and after it; and what is free after the last one summed, where it differs.
        self.steps: list[list[tuple[str, Resources, Resources]]] = []
        self.summed: dict[str, Resources] = {}

    def _sum(self, releases: int) -> list[list[tuple[str, Resources, Resources]]]:
        """The steps of the first `releases` releases (summed when first asked for)."""
        steps = self.steps
        if len(steps) < releases:
            base, summed = self.cycle.free_now.free, self.summed
            for held in self.timed[len(steps):releases]:
                step = []
                for name, amount in held.items():
                    if name in base:
                        old = summed.get(name, base[name])
                        summed[name] = new = old + amount
                        step.append((name, old, new))
                steps.append(step)
        return steps

    def first_fit(self, job: QueuedJob, flavor: Flavor, count: int, last: int,
                  ) -> tuple[int | None, list[Placement], dict[str, Resources]] | None:
        """The first instant (an index into `times`, at most `last`) at which `count` ranks of `flavor` fit, with their
        placement and what is free then; (None, [], {}) when they fit at none of them; None when a placement does not
        bear the count out (then the search over instants decides)."""
        cycle, spec, exclude = self.cycle, job.spec, job.excluded_nodes
        now = cycle.free_now
        key, _ = cycle.cluster.eligible(spec, flavor, exclude)
        need = Resources.of_flavor(flavor)
        room, index, applied, first = self._walk(key, need, now._index(spec, flavor, exclude).room, count, last)
        free, before = self._free_at(applied, first)
        then = Capacity.over(now, free)
        placement = place(then, spec, flavor, count, exclude)
        if room < count:  # at no instant up to `last`: so it must be
            return (None, [], {}) if placement is None else None
        if placement is None:
            return None
        if index:  # and not an instant sooner
            earlier = dict(free)
            for name, old in reversed(before):
                earlier[name] = old
            if place(Capacity.over(now, earlier), spec, flavor, count, exclude) is not None:
                return None
        return index, placement, then.free

    def _walk(self, key: _EligibilityKey, need: Resources, room: int, count: int, last: int,
              ) -> tuple[int, int, int, int]:
        """From `room` (for ranks needing `need` on the nodes of `key`, now), instant by instant up to the first where
        there is room for `count` of them, or `last`: the room there, the instant, how many releases have happened by
        then and how many had before it."""
        eligible = self.cycle.cluster.eligible_set(key)
        applied, index, first = 0, 0, 0  # releases summed; the instant reached; its first release
        ends, times = self.ends, self.times
        while True:
            first = applied
            released = bisect.bisect_right(ends, times[index])
            if released > applied:
                for step in self._sum(released)[applied:released]:
                    for name, old, new in step:
                        if name in eligible:
                            room += _room(need, new) - _room(need, old)
                applied = released
            if room >= count or index == last:
                return room, index, applied, first
            index += 1

    def _free_at(self, applied: int, first: int) -> tuple[dict[str, Resources], list[tuple[str, Resources]]]:
        """What is free once the first `applied` releases happened, where it differs from now; and what the releases
        from `first` on changed, as it was before them."""
        free: dict[str, Resources] = {}
        before: list[tuple[str, Resources]] = []
        for release in range(applied):
            for name, old, new in self.steps[release]:
                free[name] = new
                if release >= first:
                    before.append((name, old))
        return free, before


_KINDS_KEPT = 16  # kinds of rank whose gains `_Releases` keeps: heads come in a few kinds at a time
_INSTANTS_KEPT = 4  # instants `_Releases` keeps what is free at
_ReleaseKey = tuple[datetime, int, str]  # its end; 0 for a running job, 1 for one of the cycle's admissions; which


class _Releases:
    """The running jobs' releases node by node, kept from one cycle to the next: per node, what is free after each
    release on it in turn (from what is free now), worked out again only where the releases on a node or what is free
    on it now changed; and per kind of rank a head asked about, how much room (`_room`) the eligible nodes gain at
    each end, as far as a search has looked. A reservation search then finds the first instant a gang fits by adding up
    those gains, where `_Counted` sums every node's releases again in each cycle. Amounts are summed in
    the release order, as everywhere."""

    def __init__(self, capacity: Capacity, held: _Held) -> None:
        self.capacity = capacity
        self.held: dict[_ReleaseKey, Mapping[str, Resources]] = {}
        self.order: list[_ReleaseKey] = []  # sorted
        self.on_node: dict[str, list[_ReleaseKey]] = {}  # each sorted
        # Per node with releases: per release on it, in order, its end and what is free before and after it.
        self.chains: dict[str, list[tuple[datetime, Resources, Resources]]] = {}
        # The same per release: each node's before and after.
        self.steps: dict[_ReleaseKey, dict[str, tuple[Resources, Resources]]] = {}
        self.gains: dict[tuple[_EligibilityKey, Resources], _Gains] = {}
        self.admitted: list[_ReleaseKey] = []  # the last cycle's admissions, taken out at the next
        # What is free at the instants heads were last reserved at (the few asked about most recently), each a capacity
        # over what is free now with its indexes, set anew on the nodes whose releases or room changed: on every node
        # where the two may differ, as a capacity made over another must be.
        self.instants: dict[datetime, Capacity] = {}
        self.dirty: set[str] = set()
        capacity.touched = set()
        for job in held.jobs:
            self._add((job.ends_at, 0, job.job_id), job.held)  # type: ignore[arg-type]

    def _add(self, key: _ReleaseKey, held: Mapping[str, Resources]) -> None:
        self.held[key] = held
        bisect.insort(self.order, key)
        self.steps[key] = {}
        for name in held:
            bisect.insort(self.on_node.setdefault(name, []), key)
        self.dirty.update(held)

    def _remove(self, key: _ReleaseKey) -> None:
        held = self.held.pop(key)
        del self.order[bisect.bisect_left(self.order, key)]
        del self.steps[key]
        for name in held:
            self.on_node[name].remove(key)
        self.dirty.update(held)

    def follow(self, held: _Held) -> None:
        """The jobs that ended or started since (`held.gone`, `held.added`)."""
        assert held.gone is not None
        for job in held.gone:
            if job.ends_at is not None:
                self._remove((job.ends_at, 0, job.job_id))
        for job in held.added:
            if job.ends_at is not None:
                self._add((job.ends_at, 0, job.job_id), job.held)

    def settle(self, admitted: Sequence[tuple[datetime | None, Mapping[str, Resources]]], now: datetime) -> None:
        """Up to date with what is free now and with this cycle's admissions so far (`Cycle.holders`)."""
        for then in [then for then in self.instants if then < now]:  # past: not asked about again
            del self.instants[then]
        for key in self.admitted:
            self._remove(key)
        self.admitted = [(end, 1, f"{index:09}") for index, (end, _) in enumerate(admitted) if end is not None]
        for key, (_, amount) in zip(self.admitted, (holder for holder in admitted if holder[0] is not None),
                                    strict=True):
            self._add(key, amount)
        touched = self.capacity.touched
        assert touched is not None
        self.dirty |= touched
        touched.clear()
        for name in self.dirty:
            self._chain(name)
            for then, capacity in self.instants.items():
                free = self.free_at(name, then)
                if free is not None:
                    capacity.set(name, free)  # (even if the same: it differs from now as it was when it was made)
        self.dirty.clear()

    def free_at(self, name: str, then: datetime) -> Resources | None:
        """What is free on a node once every release up to `then` happened."""
        free = self.capacity.free.get(name)
        for end, _, after in self.chains.get(name, ()):
            if end > then:
                break
            free = after
        return free

    def at(self, then: datetime) -> Capacity:
        """What is free at `then`, kept (made when first asked)."""
        capacity = self.instants.pop(then, None)
        if capacity is None:
            if len(self.instants) >= _INSTANTS_KEPT:
                del self.instants[next(iter(self.instants))]
            capacity = Capacity.over(self.capacity, self._changed_by(then))
        self.instants[then] = capacity  # (last, as the one asked about most recently)
        return capacity

    def _changed_by(self, then: datetime) -> dict[str, Resources]:
        """What is free once every release up to `then` happened, where they changed it."""
        steps, order = self.steps, self.order
        free: dict[str, Resources] = {}
        for key in order[:bisect.bisect_right(order, (then, 2, ""))]:
            for name, (_, new) in steps[key].items():
                free[name] = new
        return free

    def _chain(self, name: str) -> None:
        old = self.chains.pop(name, [])
        keys = self.on_node.get(name)
        free = self.capacity.free.get(name)
        new: list[tuple[datetime, Resources, Resources]] = []
        if keys and free is not None:
            for key in keys:
                after = free + self.held[key][name]
                new.append((key[0], free, after))
                self.steps[key][name] = (free, after)
                free = after
            self.chains[name] = new
        elif not keys:
            self.on_node.pop(name, None)
        for (_, need), kind in self.gains.items():
            horizon = kind.horizon
            if horizon is None or name not in kind.eligible:
                continue
            for end, before, after in old:
                if end > horizon:
                    break
                kind.gain(end, _room(need, before) - _room(need, after))
            for end, before, after in new:
                if end > horizon:
                    break
                kind.gain(end, _room(need, after) - _room(need, before))

    def gains_of(self, key: _EligibilityKey, need: Resources, eligible: frozenset[str]) -> _Gains:
        """The gains of the nodes of `key` for ranks needing `need` (`_Gains`)."""
        kind = self.gains.pop((key, need), None)
        if kind is None:
            if len(self.gains) >= _KINDS_KEPT:  # each kept is kept up to date: the one asked about least recently goes
                del self.gains[next(iter(self.gains))]
            kind = _Gains(eligible, need, self)
        self.gains[(key, need)] = kind  # (last, as the one asked about most recently)
        return kind


class _Gains:
    """Per end, the room the eligible nodes gain for ranks needing `need` as the releases then happen: worked out for
    the ends up to `horizon`, further when a search looks further (`until`), and kept up to date to there."""

    def __init__(self, eligible: frozenset[str], need: Resources, releases: _Releases) -> None:
        self.eligible, self.need, self.releases = eligible, need, releases
        self.gains: dict[datetime, int] = {}
        self.horizon: datetime | None = None  # None: nothing worked out yet

    def until(self, then: datetime) -> dict[datetime, int]:
        """The gains, worked out for every end up to `then` at least."""
        horizon = self.horizon
        if horizon is None or then > horizon:
            releases, eligible, need = self.releases, self.eligible, self.need
            order = releases.order
            start = 0 if horizon is None else bisect.bisect_right(order, (horizon, 2, ""))
            for key in order[start:bisect.bisect_right(order, (then, 2, ""))]:
                gained = 0
                for name, (before, after) in releases.steps[key].items():
                    if name in eligible:
                        gained += _room(need, after) - _room(need, before)
                self.gain(key[0], gained)
            self.horizon = then
        return self.gains

    def gain(self, end: datetime, amount: int) -> None:
        """`amount` more room at `end`; an end with none gained is not kept (ends pass, the gains stay flat)."""
        if amount:
            total = self.gains.get(end, 0) + amount
            if total:
                self.gains[end] = total
            else:
                del self.gains[end]


class _CountedKept(_Counted):
    """`_Counted` over the releases a cycle kept (`_Releases`): the room at each instant is the room now plus the
    gains up to it, and the head is placed on what is free then as kept (`_Releases.at`)."""

    def __init__(self, cycle: Cycle, ends: Sequence[datetime], timed: Sequence[Mapping[str, Resources]],
                 times: Sequence[datetime], releases: _Releases) -> None:
        super().__init__(cycle, ends, timed, times)
        self.releases = releases
        releases.settle(cycle.holders, cycle.now)
        held = cycle.held
        # Every end up to now releases at the first instant.
        self.past = {*held.distinct[:bisect.bisect_right(held.distinct, cycle.now)], cycle.now}

    def first_fit(self, job: QueuedJob, flavor: Flavor, count: int, last: int,
                  ) -> tuple[int | None, list[Placement], dict[str, Resources]] | None:
        """As `_Counted.first_fit`, but taking the count's word where it finds no room: its gains are kept from cycle
        to cycle, and a kept cycle decides as one from scratch (whose counts are checked by placements) does. The
        placement at the instant found is made all the same: it places the head. The count is exact where ranks are
        all alike, and it is the count a placement would make (`tests/unit/test_scheduling_kept.py` checks both)."""
        cycle, spec, exclude = self.cycle, job.spec, job.excluded_nodes
        now = cycle.free_now
        key, _ = cycle.cluster.eligible(spec, flavor, exclude)
        room, index = self._reach(key, Resources.of_flavor(flavor), now._index(spec, flavor, exclude).room, count, last)
        if room < count:
            return None, [], {}
        then = self.releases.at(self.times[index])
        placement = place(then, spec, flavor, count, exclude)
        return None if placement is None else (index, placement, then.free)

    def _reach(self, key: _EligibilityKey, need: Resources, room: int, count: int, last: int) -> tuple[int, int]:
        """From `room` (for ranks needing `need` on the nodes of `key`, now), instant by instant up to the first where
        there is room for `count` of them, or `last`: the room there, and the instant."""
        kind = self.releases.gains_of(key, need, self.cycle.cluster.eligible_set(key))
        times = self.times
        gains = kind.until(times[0])
        room += sum(gains.get(end, 0) for end in self.past)
        index = 0
        while room < count and index < last:
            index += 1
            if times[index] > kind.horizon:  # type: ignore[operator]  # look a little further
                gains = kind.until(times[min(last, index + 64)])
            room += gains.get(times[index], 0)
        return room, index


class Cycle:
    """One pass over the queue. Capacity only shrinks during a cycle, so a job shape that failed on
    some capacity is remembered and not tried again on it.

    A cycle can be run over the queue in parts (`run` once per stretch of it) and forked between
    them: the prediction cache keeps a cycle stopped at each place a new job can join the queue.
    """

    def __init__(self, nodes: list[NodeCapacity], flavors: Mapping[str, Flavor], running: Sequence[RunningJob],
                 now: datetime, *, cluster: Cluster | None = None, keep: bool = False,
                 running_change: RunningChange | None = None) -> None:
        """`keep`: take what the last cycle over `cluster` kept (`_Kept`), for this cycle alone to use and change;
        `running_change`: how `running` differs from the running jobs that cycle was given."""
        self.cluster = Cluster(n.info for n in nodes) if cluster is None else cluster
        self.flavors = flavors
        self.running = list(running)
        self.now = now
        kept, self.cluster.kept = (self.cluster.kept, None) if keep else (None, self.cluster.kept)
        self.failed_now: set[Shape] = set()
        self.failed_extra: set[Shape] = set()
        # What a backfill's capacity (`extra`) was made from, and the shapes that failed on it last cycle: they fail
        # again on one made from the same.
        self.extra_made: tuple[object, ...] | None = None
        self._kept_extra: tuple[tuple[object, ...] | None, set[Shape]] = (None, set())
        if kept is not None and kept.capacity.update(nodes):
            self.free_now = kept.capacity
            if kept.capacity.revision == kept.revision:  # nothing is free that was not at the end of the last cycle
                self.failed_now = kept.failed_now
                self._kept_extra = (kept.extra_made, kept.failed_extra)
        else:
            self.free_now = Capacity(self.cluster, {n.info.name: n.free for n in nodes})
            if keep:
                self.free_now.remember(nodes)
        self._held: _Held | None = None
        if kept is not None and kept.held is not None:  # the same running jobs, or a few more or fewer
            self._held = self._held_since(kept.held, kept.given, running_change)
        # The releases node by node (`_Releases`), kept by the cycles of a scheduler and made when a head first needs
        # them: over the capacity kept, following the jobs that ended or started.
        self.keep = keep
        self.releases: _Releases | None = None
        if kept is not None and kept.releases is not None and self.free_now is kept.capacity and self._held is not None:
            if self._held is kept.held:
                self.releases = kept.releases
            elif self._held.gone is not None:
                self.releases = kept.releases
                self.releases.follow(self._held)
        # Whether a job shape fits the empty cluster at all, and how many ranks of a kind it holds: they depend on
        # the nodes and the flavors only, so cycles over the same `Cluster` (a simulation's) share them.
        self.placeable: dict[Shape, bool] = self.cluster.placeable
        self.most_workers: dict[tuple[_EligibilityKey, Resources], int] = self.cluster.most_workers
        self.admissions: list[Admission] = []
        # What this cycle's admissions hold, and until when (None: no limit); the running jobs' is in `held`.
        self.holders: list[tuple[datetime | None, Mapping[str, Resources]]] = []
        self.unplaceable: list[str] = []
        self.head: _Head | None = None
        # Per node: what stays free at the head's start once the head has its share (backfills that
        # outlive the start are taken from it), and what a backfill may use now without delaying the head.
        self.after_head: dict[str, Resources] = {}
        self.extra: Capacity | None = None
        self.totals: Capacity | None = None

    def _held_since(self, held: _Held, given: Sequence[RunningJob] | None, change: RunningChange | None) -> _Held:
        """What the running jobs hold, from what they held last cycle (`held`, given as `given`): told how they changed
        since (`change`, about that very list), or else found by comparing the two lists."""
        if (change is not None and change.before is given
                and len(held.running) - len(change.gone) + len(change.added) == len(self.running)):
            return held.changed(self.running, change.gone, change.added) if change.gone or change.added else held
        same = len(held.running) == len(self.running) and all(map(operator.is_, held.running, self.running))
        return held if same else held.then(self.running)  # (by identity: equal jobs made anew are other jobs)

    @property
    def held(self) -> _Held:
        """What the running jobs hold and until when, worked out when first asked."""
        if self._held is None:
            self._held = _Held(self.running)
        return self._held

    def fork(self) -> Cycle:
        """A copy of this cycle part-way through the queue, to go on with while this one stays as it is.
        What a cycle only reads (the cluster, the flavors, the head's reservation) is shared."""
        twin = copy.copy(self)
        twin.keep, twin.releases = False, None  # what is kept belongs to this one
        twin.running = list(self.running)
        twin.free_now = self.free_now.copy()
        twin.failed_now, twin.failed_extra = set(self.failed_now), set(self.failed_extra)
        twin.admissions, twin.holders = list(self.admissions), list(self.holders)
        twin.unplaceable = list(self.unplaceable)
        twin.after_head = dict(self.after_head)
        twin.extra = None if self.extra is None else self.extra.copy()
        twin.totals = None if self.totals is None else self.totals.copy()
        return twin

    def run(self, queue: list[QueuedJob], *, grow: bool = True) -> Decision:
        """Walk `queue` (the next stretch of it, in start order), then grow what may grow (unless `grow` is
        False: more of the queue is still to come)."""
        failed, placeable = self.failed_now, self.placeable
        jobs = iter(queue)
        if self.head is None:
            for job in jobs:
                shape = job.shape
                if shape in failed and placeable.get(shape) is False:
                    self.unplaceable.append(job.job_id)  # like a job before it, it fits nowhere at all
                    continue
                self._admit_in_order(job, shape)
                if self.head is not None:
                    break
        if self.head is not None:
            self._behind_head(jobs)
        growths = self._grow() if grow else []
        return Decision(admissions=self.admissions, growths=growths,
                        reservation=self.head.reservation if self.head else None, unplaceable=self.unplaceable)

    # --- walking the queue -------------------------------------------------------------------------

    def _try(self, job: QueuedJob, shape: Shape, capacity: Capacity, failed: set[Shape]) -> Choice | None:
        if shape in failed:
            return None
        choice = choose(capacity, job.spec, self.flavors, job.excluded_nodes, job.prefer, shape=shape)
        if choice is None:
            failed.add(shape)
        return choice

    def _admit(self, job: QueuedJob, choice: Choice, *, backfilled: bool) -> dict[str, Resources]:
        flavor_name, placement = choice
        held = holdings(placement, self.flavors[flavor_name])
        self.free_now.take(held)
        ends = self.now + timedelta(seconds=job.duration_seconds) if job.duration_seconds is not None else None
        self.holders.append((ends, held))
        self.admissions.append(Admission(job_id=job.job_id, flavor=flavor_name, placement=placement,
                                         dropped_flavors=[f for f in job.spec.flavors if f != flavor_name],
                                         backfilled=backfilled))
        return held

    def _admit_in_order(self, job: QueuedJob, shape: Shape) -> None:
        choice = self._try(job, shape, self.free_now, self.failed_now)
        if choice is not None:
            self._admit(job, choice, backfilled=False)
            return
        self.head = self._reserve(job) if self._placeable(job, shape) else None
        if self.head is None:
            self.unplaceable.append(job.job_id)
        else:
            # Free at the start only grows from what is free now, so a backfill may use all that is free now but on
            # the head's nodes.
            at_start = self.head.at_start
            self.after_head = dict(at_start)
            for name, amount in self.head.held.items():
                if name in at_start:
                    self.after_head[name] = at_start[name] - amount
            backfill_room = {name: least(self.free_now.free[name], self.after_head[name])
                             for name in self.head.held if name in at_start}
            self.extra = Capacity.over(self.free_now, backfill_room)
            self.extra_made = (self.free_now, self.free_now.revision, self.head.reservation,
                               tuple(backfill_room.items()))
            if self._kept_extra[0] == self.extra_made:
                self.failed_extra = self._kept_extra[1]

    def _behind_head(self, jobs: Iterable[QueuedJob]) -> None:
        """Each job behind the head: backfilled if it can be (`_backfill`). Like a job before it, most fit nowhere
        they may go now, and a deep queue of such jobs costs a few lookups each."""
        assert self.head is not None
        failed_now, failed_extra, placeable, unplaceable = (self.failed_now, self.failed_extra, self.placeable,
                                                            self.unplaceable)
        start = self.head.reservation.start
        # A job ends in time when its limit runs out no later than the head's start: no more than `slack` from now.
        slack = None if start is None else (start - self.now) // _MICROSECOND
        for job in jobs:
            shape = job.shape
            duration = job.duration_seconds
            in_time = slack is not None and duration is not None and duration * 1_000_000 <= slack
            if shape in failed_now or (not in_time and shape in failed_extra):
                known = placeable.get(shape)
                if known is False or (known is None and not self._placeable(job, shape)):
                    unplaceable.append(job.job_id)
                continue
            self._backfill(job, shape, in_time)

    def _backfill(self, job: QueuedJob, shape: Shape, ends_in_time: bool) -> None:
        """Start a job behind the head only if it cannot delay the head's reservation: it ends before
        the reserved start, or it uses only what the head will not need then."""
        assert self.head is not None and self.extra is not None
        if ends_in_time:
            choice = self._try(job, shape, self.free_now, self.failed_now)
        elif shape in self.failed_now:
            choice = None
        else:
            choice = self._try(job, shape, self.extra, self.failed_extra)
        if choice is None:
            if not self._placeable(job, shape):
                self.unplaceable.append(job.job_id)
            return
        held = self._admit(job, choice, backfilled=True)
        for name, amount in held.items():
            if not ends_in_time:
                self.after_head[name] = self.after_head[name] - amount
            self.extra.set(name, least(self.free_now.free[name], self.after_head[name]))

    # --- the head's reservation ----------------------------------------------------------------------

    def ever_fits(self, job: QueuedJob) -> bool:
        """Whether the job fits on the cluster when it is empty, with any of its flavors."""
        return self._placeable(job, job.shape)

    def _placeable(self, job: QueuedJob, shape: Shape) -> bool:
        """Whether the job fits on the cluster when it is empty, with any of its flavors."""
        known = self.placeable.get(shape)
        if known is None:
            smallest = worker_counts(job.spec)[-1]
            known = any(self._fits_empty(job.spec, self.flavors[name], smallest, job.excluded_nodes)
                        for name in job.spec.flavors if name in self.flavors)
            self.placeable[shape] = known
        return known

    def _fits_empty(self, spec: JobSpec, flavor: Flavor, workers: int, exclude: frozenset[str]) -> bool:
        key, names = self.cluster.eligible(spec, flavor, exclude)
        need = Resources.of_flavor(flavor)
        totals = self.cluster.totals
        if not parameter_server_count(spec):
            most = self.most_workers.get((key, need))
            if most is None:
                most = sum(_slots(need, totals[name]) for name in names)
                self.most_workers[(key, need)] = most
            return most >= workers
        # Workers and parameter servers compete for nodes, so only a real placement tells. Trying a few
        # roomy nodes first keeps that cheap; a placement there is a placement on the whole cluster.
        few: list[str] = []
        room = 0
        for name in names:
            if room >= workers + parameter_server_count(spec):
                break
            if slots := _slots(need, totals[name]):
                few.append(name)
                room += slots
        subset = Cluster(self.cluster.infos[name] for name in few)
        if place(Capacity(subset, {name: totals[name] for name in few}), spec, flavor, workers, exclude) is not None:
            return True
        if self.totals is None:
            self.totals = Capacity(self.cluster, dict(totals))
        return place(self.totals, spec, flavor, workers, exclude) is not None

    def _releases(self) -> tuple[list[datetime], list[Mapping[str, Resources]], list[datetime]]:
        """What is held until a known end (sorted by end: the running jobs in the release order, then this cycle's
        admissions in their order; an overdue job releases now), and the instants from now on at which something is
        released. Jobs admitted earlier in this cycle count as running from now."""
        held, now = self.held, self.now
        overdue = bisect.bisect_right(held.ends, now)
        ends = [now] * overdue + held.ends[overdue:]  # all release now, in their order
        timed = list(held.timed)
        times = [now, *held.distinct[bisect.bisect_right(held.distinct, now):]]
        for end, amount in self.holders:
            if end is None:
                continue
            end = max(end, now)
            index = bisect.bisect_right(ends, end)  # after the running jobs and the admissions ending then
            ends.insert(index, end)
            timed.insert(index, amount)
            index = bisect.bisect_left(times, end)
            if index == len(times) or times[index] != end:
                times.insert(index, end)
        return ends, timed, times

    def _capacity_after(self, released: Iterable[Mapping[str, Resources]]) -> Capacity:
        capacity = self.free_now.copy()
        for held in released:
            for name, amount in held.items():
                if name in capacity.free:
                    capacity.free[name] = capacity.free[name] + amount
        return capacity

    def _reserve(self, job: QueuedJob) -> _Head | None:
        """The earliest time the head's gang fits, given that running jobs end by their duration
        limits: the full size first, then (elastic) smaller sizes; with no such time, the start is
        unknown and the nodes are reserved on what would be free once every running job ended."""
        ends, timed, times = self._releases()
        timeline: _Timeline | None = None

        def capacity_at(index: int) -> Capacity:
            nonlocal timeline
            if timeline is None:
                timeline = _Timeline(self.free_now, timed)
            return timeline.at(bisect.bisect_right(ends, times[index]))

        counted = self._counted(ends, timed, times) if not parameter_server_count(job.spec) else None
        for count in worker_counts(job.spec):
            best: tuple[int, str, list[Placement]] | None = None
            best_free: dict[str, Resources] | None = None  # free at the best start, when the count found it
            for name in job.spec.flavors:
                flavor = self.flavors.get(name)
                last = len(times) - 1 if best is None else best[0] - 1  # a later flavor must start earlier
                if flavor is None or last < 0:
                    continue
                counted_fit = counted.first_fit(job, flavor, count, last) if counted is not None else None
                if counted_fit is not None:
                    if counted_fit[0] is not None:
                        best, best_free = (counted_fit[0], name, counted_fit[1]), counted_fit[2]
                    continue  # (or it fits at no instant up to `last`)
                # Free capacity only grows with time: look at instants 0, 1, 3, 7... until it fits (the head of a
                # busy cluster mostly starts soon, and only the releases up to then are summed), then in between.
                low, high, step = 0, 0, 1
                while (placement := place(capacity_at(high), job.spec, flavor, count, job.excluded_nodes)) is None:
                    if high == last:
                        break
                    low, high, step = high + 1, min(high + step, last), step * 2
                if placement is None:
                    continue
                while low < high:
                    middle = (low + high) // 2
                    found = place(capacity_at(middle), job.spec, flavor, count, job.excluded_nodes)
                    if found is None:
                        low = middle + 1
                    else:
                        high, placement = middle, found
                best, best_free = (high, name, placement), None
            if best is not None:
                index, name, placement = best
                free = best_free if best_free is not None else capacity_at(index).free
                return self._head(job, name, placement, times[index], free)
        untimed = [*self.held.untimed, *(amount for end, amount in self.holders if end is None)]
        everything = self._capacity_after([*timed, *untimed])
        # Totals only matter when something not listed as running holds resources forever.
        for capacity in (everything, Capacity(self.cluster, dict(self.cluster.totals))):
            choice = choose(capacity, job.spec, self.flavors, job.excluded_nodes)
            if choice is not None:
                return self._head(job, choice[0], choice[1], None, everything.free)
        return None  # a TensorFlow gang that fits an empty cluster only in an order this placement does not try

    def _counted(self, ends: list[datetime], timed: list[Mapping[str, Resources]], times: list[datetime]) -> _Counted:
        """The search by counting: over the releases kept, for a cycle that keeps them."""
        if not self.keep:
            return _Counted(self, ends, timed, times)
        if self.releases is None:
            self.releases = _Releases(self.free_now, self.held)
        return _CountedKept(self, ends, timed, times, self.releases)

    def _head(self, job: QueuedJob, flavor: str, placement: list[Placement], start: datetime | None,
              at_start: dict[str, Resources]) -> _Head:
        return _Head(reservation=Reservation(job_id=job.job_id, flavor=flavor, start=start,
                                             nodes=[p.node for p in placement]),
                     at_start=dict(at_start), held=holdings(placement, self.flavors[flavor]))

    # --- S10: growing shrunken elastic jobs ---------------------------------------------------------------

    def _grow(self) -> list[Growth]:
        """Grow shrunken elastic jobs on what this cycle's admissions left, never into the head's
        reservation. What a job gives up while it moves is not handed to anyone else this cycle."""
        growths: list[Growth] = []
        start = self.head.reservation.start if self.head else None
        # What any job may take now: free now, and (with a head) not needed by the head at its start.
        spare = self.extra if self.extra is not None else self.free_now
        for job in self.held.growable:
            own = job.held
            # At the head's start the job still holds its nodes unless it will have ended by then.
            own_at_start = {} if job.ends_at is not None and start is not None and job.ends_at <= start else own
            mine: dict[str, Resources] = {}  # what is free for it on its own nodes: what it holds there too
            for name, amount in own.items():
                if name in spare.free:
                    now = self.free_now.free[name] + amount
                    if self.head is not None:
                        now = least(now, self.after_head[name] + own_at_start.get(name, Resources()))
                    mine[name] = now
            room = Capacity.over(spare, mine)  # (dropped before `spare` changes, below)
            current = sum(1 for p in job.placement if p.role == "worker")
            placement = None
            for count in range(job.spec.nodes, current, -1):
                placement = place(room, job.spec, job.flavor, count, job.excluded_nodes)
                if placement is not None:
                    break
            if placement is None:
                continue
            growths.append(Growth(job_id=job.job_id, flavor=job.flavor.name, placement=placement))
            for name, amount in holdings(placement, job.flavor).items():
                self.free_now.set(name, self.free_now.free[name] - _excess(amount, own.get(name)))
                if self.extra is not None:
                    self.after_head[name] = self.after_head[name] - _excess(amount, own_at_start.get(name))
                    self.extra.set(name, least(self.free_now.free[name], self.after_head[name]))
        return growths



def may_grow(job: RunningJob) -> bool:
    """S10: a running elastic job short of its size that allows scaling up and is not being moved."""
    elastic = job.spec.checkpoint_resume.elastic if job.spec.checkpoint_resume else None
    if not job.can_grow or elastic is None or not elastic.allow_scale_up:
        return False
    return sum(1 for p in job.placement if p.role == "worker") < job.spec.nodes


def _excess(amount: Resources, own: Resources | None) -> Resources:
    """What `amount` takes beyond `own`, per resource."""
    if own is None:
        return amount
    return Resources(cpus=max(amount.cpus - own.cpus, 0.0), memory_mib=max(amount.memory_mib - own.memory_mib, 0),
                     accelerators=max(amount.accelerators - own.accelerators, 0))
