"""Performance detection (M6): the ratio hardware time / e2e time of a job's iterations, per rank.

Jobs print `this iteration hardware time is H and e2e time is E ms` once per iteration. For each
(job, attempt, rank) the last `window` ratios are kept; when the window is full and its mean is
past the threshold (above it, or below it) an incident opens, once; it closes when the mean is back
on the other side, and a later crossing opens the next one. Nothing here does I/O: the monitor feeds
the scheduler's events (which attempts to watch) and log chunks in, and records what comes out.

Log lines are many and performance lines few, so a chunk is scanned as one string: most chunks are
passed over by a single substring search, and the rest by one regular-expression scan.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSucceeded,
)
from libs.contracts.health import PERFORMANCE_LINE
from libs.contracts.jobspec import PerformanceDetection
from libs.jobstatus import JobRecord

_MARKER = "hardware time is"
# The contract's pattern with its spaces kept within one line: a chunk is scanned joined, and one
# line is one iteration.
_finditer = re.compile(PERFORMANCE_LINE.pattern.replace(r"\s", r"[^\S\n]")).finditer
# How often the running sum is recomputed exactly, so float error cannot build up over long runs.
_RESYNC_EVERY = 4096

RankKey = tuple[str, int, int]  # (job id, attempt, rank)
# The current attempt of a job is ending (or moving): its log lines no longer count.
ATTEMPT_ENDING = (JobResuming, JobRestarting, JobRescaling, JobRequeued, JobExpiring, JobStopRequested,
                  JobSucceeded, JobFailed, JobStopped, JobExpired, JobDeleted)


class ChunkLike(Protocol):
    """What is read from a log chunk (libs.contracts.agent.LogChunk has these fields)."""

    @property
    def job_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def lines(self) -> Sequence[str]: ...


def _text(lines: Sequence[str]) -> str:
    return lines[0] if len(lines) == 1 else "\n".join(lines)


def ratios(lines: Sequence[str]) -> list[float]:
    """hardware / e2e of every performance line in `lines`, in order (lines with e2e 0 are skipped)."""
    found: list[float] = []
    text = _text(lines)
    if _MARKER in text:
        for match in _finditer(text):
            hardware, e2e = match.groups()
            if float(e2e) > 0:
                found.append(float(hardware) / float(e2e))
    return found


@dataclass
class RankWindow:
    """The sliding window of one (job, attempt, rank)."""

    threshold: float
    above: bool
    size: int
    incidents: int = 0  # opened so far
    open: bool = False
    values: deque[float] = field(default_factory=deque)
    total: float = 0.0
    _added: int = 0

    @classmethod
    def of(cls, rule: PerformanceDetection, recorded: int = 0) -> RankWindow:
        # An incident recorded before a restart may still be going on: it stays open until the
        # mean is seen back on the other side, so it is never recorded twice.
        return cls(threshold=rule.threshold, above=rule.direction == "above", size=rule.window,
                   incidents=recorded, open=recorded > 0)

    def feed(self, lines: Sequence[str]) -> list[float]:
        """The means of the incidents these lines open.

        The hot path of log reading: the window is updated in local variables (see `ratios` for the
        parsing it repeats).
        """
        text = _text(lines)
        if _MARKER not in text:
            return []
        opened: list[float] = []
        values, size, threshold, above = self.values, self.size, self.threshold, self.above
        total, is_open, added = self.total, self.open, self._added
        for match in _finditer(text):
            hardware, e2e = match.groups()
            divisor = float(e2e)
            if divisor <= 0:
                continue
            ratio = float(hardware) / divisor
            if len(values) == size:
                total -= values.popleft()
            values.append(ratio)
            total += ratio
            added += 1
            if added >= _RESYNC_EVERY:
                total, added = math.fsum(values), 0
            if len(values) < size:
                continue
            mean = total / size
            crossed = mean > threshold if above else mean < threshold
            if crossed != is_open:  # opens, or closes when back on the other side
                is_open = crossed
                if crossed:
                    opened.append(mean)
        self.total, self.open, self._added = total, is_open, added
        self.incidents += len(opened)
        return opened


@dataclass(frozen=True)
class Incident:
    """A window's mean crossed the job's threshold: the `number`-th incident of this rank's attempt."""

    job_id: str
    attempt: int
    rank: int
    node: str
    ratio: float
    number: int
    rule: PerformanceDetection


@dataclass
class _Watch:
    attempt: int
    rule: PerformanceDetection
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> the node its placement put it on


class PerformanceDetector:
    """The windows of every watched job's current attempt.

    `recorded` maps (job, attempt, rank) to the incidents already recorded (the monitor folds its
    PerformanceDegraded events into it), so a window made after a restart knows about them.
    """

    def __init__(self, recorded: MutableMapping[RankKey, int] | None = None) -> None:
        self.recorded: MutableMapping[RankKey, int] = recorded if recorded is not None else {}
        self._jobs: dict[str, _Watch] = {}
        self._windows: dict[RankKey, RankWindow] = {}

    def follow(self, envelope: EventEnvelope, job: JobRecord | None) -> None:
        """Follow the scheduler: watch each admitted attempt of a job that asks for detection (`job`,
        as folded with this event), until that attempt ends or moves."""
        event = envelope.event
        if isinstance(event, JobAdmitted):
            resume = job.spec.checkpoint_resume if job else None
            if resume is not None and resume.performance is not None:
                self.watch(event.job_id, event.attempt, resume.performance,
                           {place.rank: place.node for place in event.placement})
        elif isinstance(event, ATTEMPT_ENDING):
            self.unwatch(envelope.aggregate_id)

    def watch(self, job_id: str, attempt: int, rule: PerformanceDetection,
              nodes: dict[int, str] | None = None) -> None:
        """Follow `attempt` of the job (and forget its earlier attempts), whose ranks run on `nodes`."""
        self.unwatch(job_id)
        self._jobs[job_id] = _Watch(attempt, rule, dict(nodes or {}))

    def unwatch(self, job_id: str) -> None:
        if self._jobs.pop(job_id, None) is not None:
            for key in [k for k in self._windows if k[0] == job_id]:
                del self._windows[key]

    def watching(self, job_id: str) -> bool:
        return job_id in self._jobs

    def misplaced(self, chunk: ChunkLike) -> str | None:
        """Why a chunk of a watched attempt cannot be its rank's output: its node is not the rank's."""
        watch = self._jobs.get(chunk.job_id)
        if watch is None or watch.attempt != chunk.attempt or not watch.nodes:
            return None
        placed = watch.nodes.get(chunk.rank)
        if placed == chunk.node:
            return None
        return f"node {chunk.node} sent output of {chunk.job_id} rank {chunk.rank}, which runs on {placed}"

    def feed(self, chunk: ChunkLike) -> list[Incident]:
        """The incidents a chunk of one rank's output opens (none for jobs or attempts not watched)."""
        watch = self._jobs.get(chunk.job_id)
        if watch is None or watch.attempt != chunk.attempt:
            return []
        key = (chunk.job_id, chunk.attempt, chunk.rank)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = RankWindow.of(watch.rule, self.recorded.get(key, 0))
        first = window.incidents + 1
        return [Incident(job_id=chunk.job_id, attempt=chunk.attempt, rank=chunk.rank, node=chunk.node,
                         ratio=mean, number=first + i, rule=watch.rule)
                for i, mean in enumerate(window.feed(chunk.lines))]
