"""A rough plan of the jobs deep in the queue, past what the conservative plan places one by one (SPEC S6).

The conservative backfill plan (backfill_plan.py) costs some 500 µs a job on 1,000 nodes, so a queue of
10,000 cannot be planned job by job within a second. Past a bound (playthrough.HORIZON_NODE_JOBS), the jobs
are *poured*, in queue order, into the room the exact plan leaves: per class of nodes (same pools, board and
driver), the free CPUs, memory and accelerators over time, summed over its nodes. A job starts, roughly, once
the room before that instant holds the work (resources times runtime) of every job poured ahead of it into the
same class, in each kind of resource; a job that may use several classes goes where it would start first. A
job without a duration limit holds its share of the class for good from its start, where that much stays free
for good; else it has no start, and holds nothing.

This is the fluid approximation of queueing theory. It ignores that a job needs its room on whole nodes and all
at once, which makes a start early, and that a job may backfill ahead of work before it, which makes it late; on
the replayed workloads rough starts lean late (docs/benchmarks.md, bench.prediction_accuracy `--planned`). Its
plans are marked rough. Pouring a job costs a few microseconds: each class keeps, per kind of resource, how far
its room has been filled, and only moves forward.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass

from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Resources
from libs.placement import QueuedJob, Shape, parameter_server_count
from services.scheduler.planning.backfill_plan import Planner
from services.scheduler.planning.profiles import FOREVER, Profiles

_KINDS = 3  # CPUs, memory, accelerators


def _amounts(resources: Resources) -> tuple[float, float, float]:
    return float(resources.cpus), float(resources.memory_mib), float(resources.accelerators)


# How far one kind of resource of a class has been filled: up to an instant (µs) in a segment, with so much area
# of room used up to it; and what jobs without a limit hold for good from that instant on.
_Fill = tuple[int, float, float, float]  # segment, instant, area, held for good


class _Room:
    """One class of nodes' free resources over time, summed (a step function), and how far each kind is filled."""

    def __init__(self, starts: list[int], free: list[tuple[float, float, float]]) -> None:
        self.starts = starts  # the segments' starts; the last segment lasts for good
        self.free = free
        self.fills: list[_Fill] = [(0, 0.0, 0.0, 0.0)] * _KINDS
        self.poured = [0.0] * _KINDS  # the work poured so far (amount times µs), per kind

    def fork(self) -> _Room:
        twin = copy.copy(self)
        twin.fills, twin.poured = list(self.fills), list(self.poured)
        return twin

    def left(self, kind: int) -> float:
        """What of this kind stays free for good, once every job with a limit has ended."""
        return self.free[-1][kind] - self.fills[kind][3]

    def reached(self, kind: int, area: float) -> _Fill | None:
        """The fill once `area` of this kind's room is used from the start (its instant: when that happens);
        None: never, the room left for good being too small."""
        segment, at, used, held = self.fills[kind]
        starts, free = self.starts, self.free
        last = len(starts) - 1
        while True:
            rate = free[segment][kind] - held
            end = FOREVER if segment == last else starts[segment + 1]
            if rate > 0:
                room = rate * (end - at)
                if used + room >= area or segment == last:
                    return segment, at + (area - used) / rate, area, held
                used += room
            elif segment == last:
                return None
            segment, at = segment + 1, float(end)


@dataclass(frozen=True)
class _Option:
    """Where a job may go: a class of nodes, with one of its flavors, and the resources it holds there."""

    node_class: Hashable
    flavor: str
    holds: tuple[tuple[int, float], ...]  # the kinds of resource it holds, and how much of each


class FluidPlan:
    """The jobs past the bound, poured in queue order into what the exact plan (`profiles`) leaves free."""

    def __init__(self, planner: Planner) -> None:
        """`planner`: the exact plan as far as it goes; it is read, never changed."""
        self.planner = planner
        self.rooms: dict[Hashable, _Room] = {}  # made when first poured into
        self.options: dict[Shape, list[_Option]] = {}  # shared by copies: they depend only on the nodes

    def fork(self) -> FluidPlan:
        twin = copy.copy(self)
        twin.rooms = {node_class: room.fork() for node_class, room in self.rooms.items()}
        return twin

    def pour(self, job: QueuedJob) -> tuple[int | None, str | None]:
        """When `job`, behind every job poured so far, roughly starts (µs from the plan's moment; None: never,
        jobs without a limit holding too much for good), and with which flavor."""
        seconds = job.duration_seconds
        options = self._options(job)
        best: tuple[float, _Option, _Room, list[tuple[int, float, _Fill]]] | None = None
        for option in options:
            room = self._room(option.node_class)
            fills: list[tuple[int, float, _Fill]] = []
            start = 0.0
            for kind, amount in option.holds:
                if seconds is None and room.left(kind) < amount:
                    break  # it would never have room for good here
                found = room.reached(kind, room.poured[kind])
                if found is None:
                    break
                fills.append((kind, amount, found))
                start = max(start, found[1])
            else:
                if best is None or start < best[0]:
                    best = (start, option, room, fills)
        if best is None:
            return None, options[0].flavor if options else None
        start, option, room, fills = best
        for kind, amount, (segment, at, used, held) in fills:
            if seconds is None:  # it holds its share for good, from where this kind's room is filled up to
                room.fills[kind] = segment, at, used, held + amount
            else:
                room.fills[kind] = segment, at, used, held
                room.poured[kind] += amount * seconds * 1_000_000
        return min(int(start), FOREVER), option.flavor

    def _options(self, job: QueuedJob) -> list[_Option]:
        shape = job.shape
        found = self.options.get(shape)
        if found is None:
            planner = self.planner
            servers = parameter_server_count(job.spec)
            extra = _amounts(Resources.of_flavor(PARAMETER_SERVER_FLAVOR))
            found = []
            seen: set[Hashable] = set()
            for name, nodes in planner.worker_nodes(job).items():
                one = _amounts(Resources.of_flavor(planner.flavors[name]))
                holds = tuple((kind, held) for kind, (a, b) in enumerate(zip(one, extra, strict=True))
                              if (held := job.spec.nodes * a + servers * b) > 0)
                for node_class in sorted({planner.node_class[node] for node in nodes} - seen, key=repr):
                    seen.add(node_class)
                    found.append(_Option(node_class, name, holds))
            self.options[shape] = found
        return found

    def _room(self, node_class: Hashable) -> _Room:
        room = self.rooms.get(node_class)
        if room is None:
            profiles, classes = self.planner.profiles, self.planner.node_class
            room = self.rooms[node_class] = _summed(profiles, [
                name for name in profiles.times if classes[name] == node_class])
        return room


def _summed(profiles: Profiles, names: list[str]) -> _Room:
    """The free resources of `names` over time, summed."""
    changes: dict[int, list[float]] = {}
    for name in names:
        before = (0.0, 0.0, 0.0)
        for moment, free in zip(profiles.times[name], profiles.frees[name], strict=True):
            now = _amounts(free)
            change = changes.setdefault(moment, [0.0] * _KINDS)
            for kind in range(_KINDS):
                change[kind] += now[kind] - before[kind]
            before = now
    starts = sorted(changes)
    summed: list[tuple[float, float, float]] = []
    total = [0.0] * _KINDS
    for moment in starts:
        total = [a + b for a, b in zip(total, changes[moment], strict=True)]
        summed.append((total[0], total[1], total[2]))
    return _Room(starts or [0], summed or [(0.0, 0.0, 0.0)])
