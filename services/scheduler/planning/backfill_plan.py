"""The conservative backfill plan of a queue (SPEC S6): the estimate past what a simulation covers.

Jobs are planned one after another in start order, each at the earliest time it fits for its whole duration
around the jobs planned before it: a job may be planned into a gap ahead of jobs before it, but never so that
it delays any of them. It is a model of the scheduler's policy, cheaper than playing the scheduler's own cycles
forward (playthrough.py), which it stands in for beyond the work a playthrough is allowed.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Flavor, Resources
from libs.contracts.events import Placement
from libs.placement import (
    Capacity,
    Choice,
    Cluster,
    Decision,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    Shape,
    choose,
    holdings,
    parameter_server_count,
    worker_counts,
)
from services.scheduler.planning.profiles import FOREVER, Profiles, merged, ranks_in

_NodeClass = tuple[tuple[str, ...], str | None, str | None]  # pools, board, driver version
_MICROSECOND = timedelta(microseconds=1)
_Role = tuple[Resources, frozenset[str], tuple[_NodeClass, ...]]  # a kind of rank, its nodes and their classes


@dataclass(frozen=True)
class Plan:
    """When one queued job is expected to start, and what that depends on."""

    job_id: str
    start: datetime | None
    flavor: str | None = None
    placement: list[Placement] = field(default_factory=list)
    # Known start: the jobs whose end lets it start. Unknown start: the jobs without a duration limit
    # it waits for.
    waits_for: list[str] = field(default_factory=list)
    behind: list[str] = field(default_factory=list)  # unknown start: jobs ahead of unknown start in its way
    unplaceable: bool = False  # fits on no node of the cluster
    rough: bool = False  # deep in the queue: a fluid estimate, not planned job by job (fluid_plan.py)



class Planner:
    """Plays the queue forward in time, as conservative backfill does.

    Jobs are planned one after another in start order, each at the earliest time at which it fits on
    enough nodes for its whole duration (its limit, or in the likely plan its likely runtime) around
    everything planned before it: a job behind others may be planned into a gap ahead of them, as
    the scheduler backfills it, but never so as to delay a job planned before it. A job without a
    duration limit needs room for good. Free resources are kept per node over time (profiles.py);
    the search visits the spans of room of the kinds of rank the job asks for in time order, and
    places the job with the scheduler's own placement on what stays free through its duration.

    The search is bounded (`max_spans` spans of room visited, `max_tries` placements tried per job):
    past that, the job is planned when nothing changes any more on the nodes it may use, which is
    late but never overcommits a node.

    Besides the plan over time, two views are kept: what will be free once every job with a duration
    limit has ended ("final"), and what would be free if every job ended ("everything"). A job that
    does not fit in "final" waits on jobs without a limit: its start is unknown and, as the scheduler
    does for a head in that state, the nodes it would take in "everything" are set aside for it from
    now on, so the jobs behind it are planned around them.
    """

    max_spans = 20_000
    max_tries = 24

    def __init__(self, nodes: list[NodeCapacity], flavors: dict[str, Flavor], running: Sequence[RunningJob],
                 now: datetime, decision: Decision, queue: list[QueuedJob], until: str | None) -> None:
        self.flavors = flavors
        self.until = until
        self.now = now
        self.final = Capacity.of(nodes)
        self.cluster = self.final.cluster
        self.everything = self.final.copy()
        self.node_class: dict[str, _NodeClass] = {
            n.info.name: (tuple(n.info.pools), n.info.board, n.info.driver_version) for n in nodes}
        self.profiles = Profiles({n.info.name: n.free for n in nodes}, self.cluster.totals, self.node_class)
        self.ending: dict[int, tuple[tuple[str, frozenset[str]], ...]] = {}  # per end, the jobs ending and nodes
        self.unlimited: list[tuple[str, Mapping[str, Resources]]] = []  # holders without a duration limit
        self.set_aside: list[tuple[str, dict[str, Resources]]] = []  # jobs of unknown start, and their nodes
        # Per job shape: the nodes it may use; per kind of rank, the nodes eligible and their classes (shared
        # by copies: they only depend on the nodes). And a placement found in "final", which holds as long
        # as none of its nodes lost room there ("final" only ever shrinks).
        self.usable: dict[Shape, set[str]] = {}
        self.eligible: dict[tuple[object, ...], tuple[frozenset[str], tuple[_NodeClass, ...]]] = {}
        self.most_ranks: dict[tuple[Resources, str], int] = {}
        self.fits_finally: dict[Shape, dict[str, int]] = {}
        self.final_shrinks: dict[str, int] = {}  # per node, how often "final" lost room on it
        self.no_room: set[Shape] = set()  # shapes that no longer fit in "everything"
        self.plans: dict[str, Plan] = {}
        self.unplaceable = set(decision.unplaceable)
        for holder in running:  # the views were built without what running jobs hold
            held = holder.held
            self.everything.give(held)
            if holder.ends_at is None:
                self.unlimited.append((holder.job_id, held))
            else:
                self.final.give(held)
                end = self._moment(holder.ends_at)
                for name, amount in held.items():
                    if name in self.profiles:
                        self.profiles.give(name, end, amount)
                self._ends(holder.job_id, held, end)
        durations = {job.job_id: job.duration_seconds for job in queue}
        for admission in decision.admissions:
            self._start(admission.job_id, holdings(admission.placement, flavors[admission.flavor]), 0,
                        durations.get(admission.job_id))
            self.plans[admission.job_id] = Plan(job_id=admission.job_id, start=now, flavor=admission.flavor,
                                                placement=admission.placement)
        self.started = dict(self.plans)  # this cycle's admissions: planned already

    def fork(self, until: str | None = None) -> Planner:
        """An independent copy to plan on, as far as this one has planned; of the plans made so far it
        keeps only those of this cycle's admissions."""
        twin = copy.copy(self)
        twin.until = until
        twin.final, twin.everything = self.final.copy(), self.everything.copy()
        twin.profiles = self.profiles.fork()
        twin.ending = dict(self.ending)
        twin.unlimited, twin.set_aside = list(self.unlimited), list(self.set_aside)
        twin.fits_finally, twin.final_shrinks = dict(self.fits_finally), dict(self.final_shrinks)
        twin.no_room, twin.unplaceable = set(self.no_room), set(self.unplaceable)
        twin.plans = dict(self.started)
        return twin  # `usable` and `eligible` only depend on the nodes: shared

    def _moment(self, when: datetime) -> int:
        """Microseconds from now (an overdue end is now)."""
        return max((when - self.now) // _MICROSECOND, 0)

    def _start(self, job_id: str, held: dict[str, Resources], start: int, seconds: int | None) -> None:
        end = FOREVER if seconds is None else min(start + seconds * 1_000_000, FOREVER)
        for name, amount in held.items():
            if name in self.profiles:
                self.profiles.take(name, start, end, amount)
        if seconds is None:
            self.unlimited.append((job_id, held))
            self._shrink_final(held)
        else:
            self._ends(job_id, held, end)

    def _ends(self, job_id: str, held: Mapping[str, Resources], end: int) -> None:
        self.ending[end] = (*self.ending.get(end, ()), (job_id, frozenset(held)))

    def _shrink_final(self, held: dict[str, Resources]) -> None:
        self.final.take(held)
        for name in held:
            self.final_shrinks[name] = self.final_shrinks.get(name, 0) + 1

    def plan(self, queue: Sequence[QueuedJob]) -> dict[str, Plan]:
        for job in queue:
            if job.job_id not in self.plans:
                self.plans[job.job_id] = self._plan(job)
            if job.job_id == self.until:
                break
        return self.plans

    def plan_job(self, job: QueuedJob) -> Plan:
        """Plan one more job behind those planned so far."""
        return self.plan([job])[job.job_id]

    def _plan(self, job: QueuedJob) -> Plan:
        if job.job_id in self.unplaceable:
            return Plan(job_id=job.job_id, start=None, unplaceable=True)
        shape = job.shape
        # A job that does not fit in "final" may still fit in a gap before jobs without a limit take
        # the nodes for good; if not, it waits for them.
        fits_finally = self._fits_finally(job, shape)
        found = None if not fits_finally and job.duration_seconds is None else self._earliest(job, fits_finally)
        if found is None:  # or it fits in "final", but in no order this placement tries on the way there
            return self._set_aside(job, shape)
        start, (flavor_name, placement) = found
        self._start(job.job_id, holdings(placement, self.flavors[flavor_name]), start, job.duration_seconds)
        return Plan(job_id=job.job_id, start=self.now + timedelta(microseconds=start), flavor=flavor_name,
                    placement=placement, waits_for=self._waits_for(start, placement))

    def _waits_for(self, start: int, placement: list[Placement]) -> list[str]:
        """The jobs whose end lets a job start at `start`: those ending then on its nodes, else all
        ending then."""
        if not start:
            return []
        ending = self.ending.get(start, ())
        nodes = {p.node for p in placement}
        return sorted({job_id for job_id, held in ending if not held.isdisjoint(nodes)}
                      or {job_id for job_id, _ in ending})

    def _fits_finally(self, job: QueuedJob, shape: Shape) -> bool:
        known = self.fits_finally.get(shape)
        if known is not None and all(self.final_shrinks.get(n, 0) == count for n, count in known.items()):
            return True
        choice = choose(self.final, job.spec, self.flavors, job.excluded_nodes)
        if choice is None:
            return False
        self.fits_finally[shape] = {p.node: self.final_shrinks.get(p.node, 0) for p in choice[1]}
        return True

    def _eligible(self, job: QueuedJob, flavor: Flavor) -> tuple[frozenset[str], tuple[_NodeClass, ...]]:
        """The nodes one rank of `flavor` of the job may use, and their classes."""
        key, names = self.cluster.eligible(job.spec, flavor, job.excluded_nodes)
        found = self.eligible.get(key)
        if found is None:
            classes = tuple(sorted(set(map(self.node_class.__getitem__, names)), key=repr))
            found = self.eligible[key] = frozenset(names), classes
        return found

    def worker_nodes(self, job: QueuedJob) -> dict[str, frozenset[str]]:
        """Per flavor of the job, the nodes one of its workers may use."""
        return {name: self._eligible(job, flavor)[0] for name in job.spec.flavors
                if (flavor := self.flavors.get(name)) is not None}

    def _usable(self, job: QueuedJob, shape: Shape) -> set[str]:
        """The nodes any rank of the job may use."""
        if shape not in self.usable:
            spec = job.spec
            kinds = [self.flavors[name] for name in spec.flavors if name in self.flavors]
            if parameter_server_count(spec):
                kinds.append(PARAMETER_SERVER_FLAVOR)
            self.usable[shape] = set().union(*(self._eligible(job, flavor)[0] for flavor in kinds))
        return self.usable[shape]

    def _earliest(self, job: QueuedJob, fits_finally: bool) -> tuple[int, Choice] | None:
        """The earliest start at which the job fits around everything planned so far, and where.

        Each span of room for one rank of a kind the job asks for (a worker of one of its flavors, a
        parameter server) becomes a candidate start when it begins, and stays one while the job's
        duration still fits in it. When the candidates offer enough ranks for one of the job's
        flavors, the job is placed on what stays free on those nodes through its duration.
        """
        spec = job.spec
        length = FOREVER if job.duration_seconds is None else job.duration_seconds * 1_000_000
        servers = parameter_server_count(spec)
        fewest = worker_counts(spec)[-1]
        roles: list[_Role] = []
        role_index: dict[tuple[frozenset[str], Resources], int] = {}

        def role(flavor: Flavor) -> int:
            nodes, classes = self._eligible(job, flavor)
            need = Resources.of_flavor(flavor)
            if (nodes, need) not in role_index:
                role_index[(nodes, need)] = len(roles)
                roles.append((need, nodes, classes))
            return role_index[(nodes, need)]

        options: list[tuple[Flavor, int, int | None]] = []  # per flavor: its workers' role, its servers' role
        for name in spec.flavors:
            flavor = self.flavors.get(name)
            if flavor is not None:
                options.append((flavor, role(flavor), role(PARAMETER_SERVER_FLAVOR) if servers else None))
        events = merged((entries, nodes, index) for index, (need, nodes, classes) in enumerate(roles)
                        for node_class in classes for entries in self.profiles.entries(node_class, need, length))
        active: list[dict[str, int]] = [{} for _ in roles]  # per role: candidate nodes and ranks they take
        counts = [0] * len(roles)
        one_rank = fewest == 1 and not servers  # any candidate will do
        rough: list[tuple[int, str]] = []  # candidates counted by what they hold when empty

        def enough() -> bool:
            return any(counts[workers] >= fewest and (ps is None or counts[ps] >= servers)
                       for _, workers, ps in options)

        windows: dict[str, Resources] = {}  # what stays free through the job's duration from `moment`
        expiry: list[tuple[int, int, str]] = []  # (last start a span allows, role, node)
        visited = tries = 0
        pending = next(events, None)
        while pending is not None and visited < self.max_spans:
            moment = pending[0]
            windows.clear()
            while expiry and expiry[0][0] < moment:
                _, index, name = heapq.heappop(expiry)
                counts[index] -= active[index].pop(name)
            added = False
            while pending is not None and pending[0] == moment:
                _, end, name, index = pending
                pending = next(events, None)
                visited += 1
                if end < FOREVER and end - moment < length:
                    continue  # too short for the job
                # At first, counted by what the node holds when empty, which is cheap and never too few.
                ranks = 1 if one_rank else self._most_ranks(roles[index][0], name)
                if ranks > 1:
                    rough.append((index, name))
                active[index][name] = ranks
                counts[index] += ranks
                heapq.heappush(expiry, (end - length if end < FOREVER else FOREVER, index, name))
                added = True
            if added and enough():
                choice = self._spread(job, moment, length, active, windows, options)
                if choice is None:
                    # Count what the new candidates really offer through the job's duration (as from
                    # when they came up), and try a placement only if that is still enough.
                    for index, name in rough:
                        if name not in active[index]:
                            continue  # gone already
                        if name not in windows:
                            windows[name] = self.profiles.window(name, moment, moment + length)
                        exact = ranks_in(roles[index][0], windows[name])
                        counts[index] += exact - active[index][name]
                        active[index][name] = exact
                    rough.clear()
                    if enough():
                        choice = self._place_at(job, moment, length, active, windows)
                        tries += 1
                if choice is not None:
                    return moment, choice
                if tries >= self.max_tries:
                    break
        return self._when_settled(job, roles) if fits_finally else None

    def _most_ranks(self, need: Resources, name: str) -> int:
        most = self.most_ranks.get((need, name))
        if most is None:
            most = self.most_ranks[(need, name)] = ranks_in(need, self.cluster.totals[name])
        return most

    def _spread(self, job: QueuedJob, moment: int, length: int, active: list[dict[str, int]],
                windows: dict[str, Resources], options: list[tuple[Flavor, int, int | None]]) -> Choice | None:
        """A job without parameter servers whose first flavor has a candidate node per worker, placed as
        `place` does: one worker on each of the candidates with the most CPUs (then memory) free through
        its duration. None when that does not apply."""
        flavor, workers, servers = options[0]
        count = job.spec.nodes
        if servers is not None or len(active[workers]) < count:
            return None
        keys = []
        for name in active[workers]:
            if name not in windows:
                windows[name] = self.profiles.window(name, moment, moment + length)
            free = windows[name]
            keys.append((-free.cpus, -free.memory_mib, name))
        infos = self.cluster.infos
        return flavor.name, [Placement(rank=rank, node=name, address=infos[name].address, slots=flavor.slots)
                             for rank, (_, _, name) in enumerate(heapq.nsmallest(count, keys))]

    def _place_at(self, job: QueuedJob, moment: int, length: int, active: list[dict[str, int]],
                  windows: dict[str, Resources]) -> Choice | None:
        """The job placed from `moment` on what stays free through its duration on the candidate nodes."""
        nodes = sorted(set().union(*active))
        for name in nodes:
            if name not in windows:
                windows[name] = self.profiles.window(name, moment, moment + length)
        room = Capacity(Cluster(self.cluster.infos[name] for name in nodes), {name: windows[name] for name in nodes})
        return choose(room, job.spec, self.flavors, job.excluded_nodes)

    def _when_settled(self, job: QueuedJob, roles: list[_Role]) -> tuple[int, Choice] | None:
        """The job placed once nothing changes any more on the nodes it may use."""
        nodes = sorted(set().union(*(names for _, names, _ in roles)))
        if not nodes:
            return None
        room = Capacity(Cluster(self.cluster.infos[name] for name in nodes),
                        {name: self.profiles.final(name) for name in nodes})
        choice = choose(room, job.spec, self.flavors, job.excluded_nodes)
        return None if choice is None else (max(self.profiles.settled(name) for name in nodes), choice)

    def _set_aside(self, job: QueuedJob, shape: Shape) -> Plan:
        waits_for: list[str] = []
        behind: list[str] = []
        if job.job_id == self.until:  # who it waits for is only told for the job asked about
            usable = self._usable(job, shape)
            waits_for = sorted({job_id for job_id, held in self.unlimited if usable.intersection(held)})
            behind = [job_id for job_id, held in self.set_aside if usable.intersection(held)]
        choice = None if shape in self.no_room else choose(self.everything, job.spec, self.flavors,
                                                           job.excluded_nodes)
        if choice is None:
            self.no_room.add(shape)  # "everything" only shrinks
        else:
            held = holdings(choice[1], self.flavors[choice[0]])
            for name, amount in held.items():
                if name in self.profiles:
                    self.profiles.take(name, 0, FOREVER, amount)
            self.everything.take(held)
            self._shrink_final(held)
            self.set_aside.append((job.job_id, held))
        return Plan(job_id=job.job_id, start=None, waits_for=waits_for, behind=behind)
