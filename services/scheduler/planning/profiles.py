"""Free resources per node over time, and where one rank of a kind fits, for planning jobs into gaps.

Times are whole microseconds from the moment of the plan (0), so that arithmetic and comparisons are
exact and cheap; `FOREVER` stands for "for good". Each node has a step function: its free resources
from each breakpoint on. For each kind of rank a planned job asks for (its resources), and each class
of nodes, the spans in which one such rank fits on a node are kept sorted by start, in bands of
length (within a factor of two), so that a search for the earliest start visits the spans of room
long enough for the job in time order instead of every node at every time.

A copy (`fork`) shares every list with the original; each side copies a list before it first
changes it, so a copy costs a few dictionary copies whatever the size of the plan.
"""

from __future__ import annotations

import bisect
import copy
import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping

from libs.contracts.cluster import Resources

FOREVER = 1 << 62  # microseconds: a time no plan reaches
Span = tuple[int, int]  # [start, end) in microseconds from the plan's moment
Entry = tuple[int, int, str]  # a span of room on one node


def ranks_in(need: Resources, free: Resources) -> int:
    """How many ranks needing `need` fit in `free`."""
    if not need.fits_in(free):
        return 0
    counts = [int((free.cpus + 1e-9) // need.cpus) if need.cpus > 0 else 1 << 30]
    if need.memory_mib > 0:
        counts.append(free.memory_mib // need.memory_mib)
    if need.accelerators > 0:
        counts.append(free.accelerators // need.accelerators)
    return max(min(counts), 1)


class Profiles:
    """Per node, free resources over time; per (node class, rank kind), the spans of room by start."""

    def __init__(self, free: Mapping[str, Resources], totals: Mapping[str, Resources],
                 node_class: Mapping[str, Hashable]) -> None:
        self.totals = totals
        self.node_class = node_class
        self.members: dict[Hashable, list[str]] = {}
        for name in free:
            self.members.setdefault(node_class[name], []).append(name)
        self.times: dict[str, list[int]] = {name: [0] for name in free}
        self.frees: dict[str, list[Resources]] = {name: [amount] for name, amount in free.items()}
        # Per (node, kind): the node's maximal spans where one rank of the kind fits, in time order.
        self.spans: dict[tuple[str, Resources], list[Span]] = {}
        # Per (class, kind, band of lengths): the nodes' spans, sorted by start. A job looks only at the
        # bands of spans long enough for it, not at the many short gaps a deep plan leaves.
        self.index: dict[tuple[Hashable, Resources, int], list[Entry]] = {}
        self.bands: dict[tuple[Hashable, Resources], tuple[int, ...]] = {}  # the bands each has lists for
        self.kinds: dict[Hashable, tuple[Resources, ...]] = {}  # kinds indexed per class
        self.own: set[tuple[str, object]] = set()  # lists this copy may change in place

    def fork(self) -> Profiles:
        twin = copy.copy(self)
        twin.times, twin.frees = dict(self.times), dict(self.frees)
        twin.spans, twin.index, twin.kinds = dict(self.spans), dict(self.index), dict(self.kinds)
        twin.bands = dict(self.bands)
        self.own, twin.own = set(), set()
        return twin

    def __contains__(self, name: str) -> bool:
        return name in self.times

    # --- reading --------------------------------------------------------------------------------------

    def window(self, name: str, start: int, end: int) -> Resources:
        """What stays free on `name` all through [start, end)."""
        times, frees = self.times[name], self.frees[name]
        first = bisect.bisect_right(times, start) - 1
        last = bisect.bisect_left(times, end, first + 1)
        lowest = frees[first]
        if last == first + 1:
            return lowest
        cpus, memory, accelerators = lowest.cpus, lowest.memory_mib, lowest.accelerators
        for free in frees[first + 1:last]:
            if free.cpus < cpus:
                cpus = free.cpus
            if free.memory_mib < memory:
                memory = free.memory_mib
            if free.accelerators < accelerators:
                accelerators = free.accelerators
        return Resources(cpus=cpus, memory_mib=memory, accelerators=accelerators)

    def settled(self, name: str) -> int:
        """From when on nothing changes on `name` any more."""
        return self.times[name][-1]

    def final(self, name: str) -> Resources:
        return self.frees[name][-1]

    def entries(self, node_class: Hashable, need: Resources, length: int) -> list[list[Entry]]:
        """The spans of room for one rank of `need` on the nodes of `node_class` that may last `length`
        (FOREVER: for good): one list per length band, each sorted by start."""
        if (node_class, need) not in self.bands:
            self._index(node_class, need)
        lowest = _BANDS - 1 if length >= FOREVER else length.bit_length()
        return [entries for band in self.bands[(node_class, need)]
                if band >= lowest and (entries := self.index[(node_class, need, band)])]

    def _index(self, node_class: Hashable, need: Resources) -> None:
        bands: dict[int, list[Entry]] = {}
        for name in self.members.get(node_class, ()):
            if need.fits_in(self.totals[name]):
                spans = self._fitting(name, need, 0, FOREVER)
                self.spans[(name, need)] = spans
                self.own.add(("spans", (name, need)))
                for start, end in spans:
                    bands.setdefault(_band(start, end), []).append((start, end, name))
        for band, entries in bands.items():
            entries.sort()
            self.index[(node_class, need, band)] = entries
            self.own.add(("index", (node_class, need, band)))
        self.bands[(node_class, need)] = tuple(sorted(bands))
        self.kinds[node_class] = (*self.kinds.get(node_class, ()), need)

    # --- changing -------------------------------------------------------------------------------------

    def take(self, name: str, start: int, end: int, amount: Resources) -> None:
        """`amount` is held on `name` from `start` until `end` (FOREVER: for good)."""
        self._change(name, start, end, amount, -1)

    def give(self, name: str, start: int, amount: Resources) -> None:
        """`amount` comes free on `name` at `start`, for good."""
        self._change(name, start, FOREVER, amount, 1)

    def _change(self, name: str, start: int, end: int, amount: Resources, sign: int) -> None:
        if start >= end:
            return
        if ("times", name) not in self.own:
            self.times[name], self.frees[name] = list(self.times[name]), list(self.frees[name])
            self.own.add(("times", name))
        times, frees = self.times[name], self.frees[name]
        first = _split(times, frees, start)
        last = _split(times, frees, end) if end < FOREVER else len(times)
        before = frees[first:last]
        for index in range(first, last):
            frees[index] = frees[index] + amount if sign > 0 else frees[index] - amount
        node_class = self.node_class[name]
        for need in self.kinds.get(node_class, ()):
            # Spans change only where a rank of the kind stopped (or started) fitting.
            if (name, need) in self.spans and any(need.fits_in(old) != need.fits_in(new)
                                                  for old, new in zip(before, frees[first:last], strict=True)):
                self._respan(name, node_class, need, start, end)
        # A job planned to start where another ends, holding as much, leaves no step: drop it.
        if last < len(times) and frees[last] == frees[last - 1]:
            del times[last], frees[last]
        if first > 0 and frees[first] == frees[first - 1]:
            del times[first], frees[first]

    def _respan(self, name: str, node_class: Hashable, need: Resources, start: int, end: int) -> None:
        """Bring the spans of `need` on `name` up to date after a change within [start, end)."""
        key = (name, need)
        if ("spans", key) not in self.own:
            self.spans[key] = list(self.spans[key])
            self.own.add(("spans", key))
        spans = self.spans[key]
        # The spans that overlap or touch the changed stretch; outside it they still hold.
        low = bisect.bisect_left(spans, (start, -1))
        if low and spans[low - 1][1] >= start:
            low -= 1
        high = low
        while high < len(spans) and spans[high][0] <= end:
            high += 1
        old = spans[low:high]
        pieces = self._fitting(name, need, start, end)
        for begin, finish in old:
            if begin < start:
                pieces.append((begin, min(finish, start)))
            if finish > end:
                pieces.append((max(begin, end), finish))
        pieces.sort()
        new: list[Span] = []
        for piece in pieces:
            if new and new[-1][1] >= piece[0]:
                new[-1] = (new[-1][0], max(new[-1][1], piece[1]))
            else:
                new.append(piece)
        if new == old:
            return
        spans[low:high] = new
        for begin, finish in old:
            entries = self._entries((node_class, need, _band(begin, finish)))
            del entries[bisect.bisect_left(entries, (begin, finish, name))]
        for begin, finish in new:
            bisect.insort(self._entries((node_class, need, _band(begin, finish))), (begin, finish, name))

    def _entries(self, key: tuple[Hashable, Resources, int]) -> list[Entry]:
        """A list of the index, to change."""
        if ("index", key) not in self.own:
            if key not in self.index:
                node_class, need, band = key
                self.bands[(node_class, need)] = tuple(sorted((*self.bands[(node_class, need)], band)))
            self.index[key] = list(self.index.get(key, ()))
            self.own.add(("index", key))
        return self.index[key]

    def _fitting(self, name: str, need: Resources, start: int, end: int) -> list[Span]:
        """The maximal stretches of [start, end) in which one rank of `need` fits on `name`."""
        times, frees = self.times[name], self.frees[name]
        index = bisect.bisect_right(times, start) - 1
        found: list[Span] = []
        opened: int | None = None
        while index < len(times) and times[index] < end:
            begin = max(times[index], start)
            if need.fits_in(frees[index]):
                if opened is None:
                    opened = begin
            elif opened is not None:
                found.append((opened, begin))
                opened = None
            index += 1
        if opened is not None:
            found.append((opened, end))
        return found


_BANDS = 64  # length bands: the bit length of a span's length in microseconds; the last one: for good


def _band(start: int, end: int) -> int:
    return _BANDS - 1 if end >= FOREVER else min((end - start).bit_length(), _BANDS - 2)


def _split(times: list[int], frees: list[Resources], moment: int) -> int:
    """The index of the step starting at `moment`, made if need be."""
    index = bisect.bisect_right(times, moment) - 1
    if times[index] == moment:
        return index
    times.insert(index + 1, moment)
    frees.insert(index + 1, frees[index])
    return index + 1


def merged(lists: Iterable[tuple[list[Entry], frozenset[str], int]]) -> Iterator[tuple[int, int, str, int]]:
    """The entries of several sorted lists in start order, each kept to its nodes and tagged."""

    def tagged(entries: list[Entry], nodes: frozenset[str], tag: int) -> Iterator[tuple[int, int, str, int]]:
        return ((start, end, name, tag) for start, end, name in entries if name in nodes)

    return heapq.merge(*(tagged(entries, nodes, tag) for entries, nodes, tag in lists))
