"""Predictions at a deep queue without planning the whole queue for every question (S6).

A new job joins the queue behind every job of its priority or higher, so it can join at only three
places, one per priority. What `predict` computes for it depends on the queue ahead only through the
scheduling cycle up to that place and the plan of the jobs ahead, the same for every job joining
there. Per state revision, the cache keeps:

- one cycle over the queue, copied at each place, so that a new job's own step (starts now, or waits
  behind how many jobs) runs on a copy;
- the queue played forward by the scheduler's own cycles (latest and likely starts, playthrough.py), only
  as far as the questions asked need, each cycle kept stopped at each place, so that a new job is tried
  at each cycle in turn on a copy.

A plan is made at one moment and reused while the revision stays the same, for at most `max_age`:
the answers are those of `forecast` at that moment (their `predicted_at`). The owner passes every
event its state folds in to `applied`, which feeds the runtime model and drops the plan when the
event changes what it was made from; a job just submitted that waits (neither starts nor becomes the
head) is taken into the plan instead, so a stream of submissions does not plan the queue each time.

A prediction is made in three steps, so that the planning can run apart from the owner (the
scheduler plans in a worker thread, `thread.py`): `begin` takes on the owner's side what the
plan needs (`PlanInputs`, copies with `JobFacts` instead of the state's live jobs, when the plan is
made afresh); `plan` plans on that and on the kept plan only; `end`, back on the owner's side, closes
it. Between `begin` and `end`, `applied` only notes what happened (jobs submitted, jobs that ended):
the submitted jobs are taken into the plan by the next prediction, and the ended ones teach the
runtime model at `end`. One prediction plans at a time. `forecast` runs the three steps in a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import NamedTuple

from libs.contracts.cluster import Flavor
from libs.contracts.events import (
    AlertMailed,
    AlertRaised,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    EventEnvelope,
    ImageDeleted,
    ImageMarked,
    ImageRegistered,
    JobExpired,
    JobFailed,
    JobPredicted,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    LaunchPlanned,
    LostProcessesStopped,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    StorageAccessSet,
)
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec, Priority
from libs.contracts.scheduling import Prediction
from libs.placement import Cycle, NodeCapacity, QueuedJob, RunningJob
from services.scheduler.planning.expected import Expected
from services.scheduler.planning.playthrough import Playthrough, cycle_bound
from services.scheduler.planning.prediction import (
    NEW_JOB,
    Forecast,
    forecast_queued,
    playthrough,
    starts_now,
    waits,
)
from services.scheduler.planning.runtime_model import JobRecord, RuntimeModel, Traits, expected_runtimes
from services.scheduler.planning.simulation import insertion_index

DEFAULT_MAX_AGE = timedelta(seconds=30)
# Events that change nothing a plan is made from; any other event makes the next prediction plan anew.
_UNPLANNED = (JobPredicted, LaunchPlanned, NodeProcessStarted, NodeProcessExited, NodeProcessLost,
              LostProcessesStopped, DebugEnvironmentKept, DebugEnvironmentReleased, AlertRaised, AlertMailed,
              StorageAccessSet, ImageRegistered, ImageMarked, ImageDeleted)
_ENDS = (JobSucceeded, JobFailed, JobStopped, JobExpired)
_PRIORITIES: tuple[Priority, ...] = ("very-urgent", "urgent", "normal")


class JobFacts(NamedTuple):
    """What the runtime model reads of a job, copied: a thread may read it while the state changes
    (a tuple: tens of thousands are made for a plan)."""

    spec: JobSpec
    creator: str
    flavor: str | None
    started_at: datetime | None
    ended_at: datetime | None
    duration_seconds: int | None

    @classmethod
    def of(cls, job: JobRecord) -> JobFacts:
        return cls(job.spec, job.creator, job.flavor, job.started_at, job.ended_at, job.duration_seconds)


@dataclass(frozen=True)
class PlanInputs:
    """What predictions are made from, as the scheduler sees it at one moment."""

    queue: list[QueuedJob]
    nodes: list[NodeCapacity]
    flavors: dict[str, Flavor]
    running: Sequence[RunningJob] = ()
    jobs: Mapping[str, JobRecord] = field(default_factory=dict)  # who submitted each job, when it started


@dataclass(frozen=True)
class _Joined:
    """A job submitted after the plan was made, to be taken into it."""

    revision: int
    job: QueuedJob
    facts: JobFacts


@dataclass(frozen=True)
class PlanTicket:
    """What one prediction plans from: new inputs, or the kept plan and the jobs submitted since."""

    revision: int
    now: datetime
    inputs: PlanInputs | None
    joined: list[_Joined]


class PredictionCache:
    """Predictions from a plan kept per state revision (see the module's description)."""

    def __init__(self, runtimes: RuntimeModel | None = None, *, max_age: timedelta = DEFAULT_MAX_AGE) -> None:
        self.runtimes = RuntimeModel() if runtimes is None else runtimes
        self.max_age = max_age
        self.revision = 0
        self._snapshot: _Snapshot | None = None
        self._joined: list[_Joined] = []  # submitted since the last other change, not yet in the plan
        self._changed_at = 0  # the revision of the last event the plan cannot take in
        self._ended: list[JobFacts] = []  # jobs that ended while a plan was being made
        self._planning = False  # between `begin` and `end`: the plan reads the runtime model

    def applied(self, envelope: EventEnvelope, jobs: Mapping[str, JobRecord]) -> None:
        """Take note of an event the state has just folded in (`jobs`: the state's jobs, after it).
        Never plans, so it is cheap on the owner's event loop."""
        event = envelope.event
        if isinstance(event, _UNPLANNED):
            return
        self.revision += 1
        if isinstance(event, JobSubmitted) and (record := jobs.get(event.job_id)) is not None:
            # A new job joins the queue as the service lists it: its spec and limit, no nodes avoided.
            job = QueuedJob(event.job_id, event.spec, record.duration_seconds)
            self._joined.append(_Joined(self.revision, job, JobFacts.of(record)))
            return
        self._changed_at, self._joined = self.revision, []
        if isinstance(event, _ENDS) and (job_record := jobs.get(event.job_id)) is not None:
            self._ended.append(JobFacts.of(job_record))
            if not self._planning:
                self._learn()

    def predict(self, spec: JobSpec, *, now: datetime, inputs: Callable[[], PlanInputs],
                duration_seconds: int | None = None) -> Prediction:
        return self.forecast(spec, now=now, inputs=inputs, duration_seconds=duration_seconds).prediction

    def forecast(self, spec: JobSpec, *, now: datetime, inputs: Callable[[], PlanInputs],
                 duration_seconds: int | None = None) -> Forecast:
        """What `prediction.forecast` answers for `spec`, as of the moment the current plan was made
        (`now`, and `inputs()` then, when it is made again)."""
        seconds = spec.max_duration_seconds if duration_seconds is None else duration_seconds
        afresh = False
        while True:
            ticket = self.begin(now, inputs, afresh=afresh)
            failed = True
            try:
                answer = self.plan(ticket, spec, seconds)
                failed = False
            finally:
                self.end(failed=failed)
            if answer is not None:
                return answer
            afresh = True  # a job taken in changes everything behind it: plan the state as it is now

    def begin(self, now: datetime, inputs: Callable[[], PlanInputs], *, afresh: bool = False) -> PlanTicket:
        """On the owner's side: what the next plan needs, taken from the state as it is (`inputs()`
        when the plan is made again: at `now`, or `afresh` when asked). Until `end`, the cache is the
        plan's."""
        if self._planning:
            raise RuntimeError("a plan is being made on this cache: one prediction plans at a time")
        joined, self._joined = self._joined, []
        snapshot = self._snapshot
        if (afresh or snapshot is None or snapshot.revision < self._changed_at
                or not snapshot.now <= now <= snapshot.now + self.max_age):
            ticket = PlanTicket(self.revision, now, inputs(), [])
        else:
            ticket = PlanTicket(self.revision, now, None, joined)
        self._planning = True
        return ticket

    def plan(self, ticket: PlanTicket, spec: JobSpec, seconds: int | None) -> Forecast | None:
        """On the planning side, between `begin` and `end`: the forecast, or None when the kept plan
        could not take in a job submitted since (then `begin` again, afresh)."""
        if ticket.inputs is not None:
            made = self._snapshot = _Snapshot(ticket.inputs, ticket.now, ticket.revision, self.runtimes)
            return made.forecast(spec, seconds)
        snapshot = self._snapshot
        assert snapshot is not None  # a ticket without inputs is only given when a plan is kept
        for joined in ticket.joined:
            if joined.revision <= snapshot.revision:
                continue
            job = joined.job
            likely = self.runtimes.runtime(Traits.of(job.spec, joined.facts.creator), job.duration_seconds)
            if joined.revision != snapshot.revision + 1 or not snapshot.join(job, likely, joined.facts):
                self._snapshot = None
                return None
            snapshot.revision = joined.revision
        if snapshot.revision != ticket.revision:
            self._snapshot = None
            return None
        return snapshot.forecast(spec, seconds)

    def begin_queued(self) -> None:
        """On the owner's side, before jobs already queued are planned together (`plan_queued`): until `end`,
        the runtime model is the plan's."""
        if self._planning:
            raise RuntimeError("a plan is being made on this cache: one prediction plans at a time")
        self._planning = True

    def plan_queued(self, inputs: PlanInputs, now: datetime, job_ids: Collection[str]) -> dict[str, Forecast]:
        """On the planning side, between `begin_queued` and `end`: the forecasts of jobs queued in `inputs`."""
        expected = expected_runtimes(self.runtimes, inputs.queue, inputs.running, inputs.jobs, now)
        return forecast_queued(job_ids, inputs.queue, inputs.nodes, inputs.flavors, running=inputs.running,
                               now=now, expected=expected)

    def end(self, *, failed: bool = False) -> None:
        """Back on the owner's side once the plan is done: the jobs that ended meanwhile teach the
        runtime model; a plan that `failed` (raised, or was given up) may be half-changed, so it goes."""
        self._planning = False
        if failed:
            self._snapshot = None
        self._learn()

    def _learn(self) -> None:
        for facts in self._ended:
            self.runtimes.job_ended(facts)
        self._ended.clear()


class _Snapshot:
    """The cycle and the plans of one state at one moment."""

    def __init__(self, inputs: PlanInputs, now: datetime, revision: int, runtimes: RuntimeModel) -> None:
        self.inputs, self.now, self.revision = inputs, now, revision
        queue = inputs.queue
        self.places = {priority: insertion_index(queue, priority) for priority in _PRIORITIES}
        # Growth comes after every admission and changes none, so the copies leave it out.
        cycle = Cycle(inputs.nodes, inputs.flavors, [job.changed(can_grow=False) for job in inputs.running], now)
        self.cycles: dict[int, Cycle] = {}
        done = 0
        for place in sorted(set(self.places.values())):
            cycle.run(queue[done:place])
            self.cycles[place], done = cycle.fork(), place
        self.decision = cycle.run(queue[done:])
        skipped = {a.job_id for a in self.decision.admissions}.union(self.decision.unplaceable)
        self.ahead = {place: sum(1 for job in queue[:place] if job.job_id not in skipped) for place in self.cycles}
        self.runtimes = runtimes
        self._expected: Expected | None = None
        self._latest: Playthrough | None = None
        self._likely: Playthrough | None = None

    @property
    def expected(self) -> Expected:
        """Likely runtimes, worked out when a job first waits (a job that starts now needs none)."""
        if self._expected is None:
            self._expected = expected_runtimes(self.runtimes, self.inputs.queue, self.inputs.running,
                                               self.inputs.jobs, self.now)
        return self._expected

    @expected.setter
    def expected(self, expected: Expected) -> None:
        self._expected = expected

    def forecast(self, spec: JobSpec, duration_seconds: int | None) -> Forecast:
        place = self.places[spec.priority]
        job = QueuedJob(NEW_JOB, spec, duration_seconds)
        step = self.cycles[place].fork().run([job], grow=False)
        if step.admissions and step.admissions[-1].job_id == NEW_JOB:
            return starts_now(step.admissions[-1], self.now)
        latest = self.latest().new_job(job)
        likely = latest if self.expected.empty else self.likely().new_job(job)
        return waits(spec, self.now, self.ahead[place], latest, likely)

    def join(self, job: QueuedJob, likely_seconds: float | None, facts: JobRecord) -> bool:
        """Take in `job`, just submitted, as if this snapshot had been made with it queued (it runs for
        `likely_seconds` in the likely plan; `facts`: who submitted it). False, and nothing changed,
        when it starts now or becomes the head: everything behind it is decided anew, so the snapshot
        must be made again."""
        queued, nodes = len(self.inputs.queue), len(self.inputs.nodes)
        if cycle_bound(nodes, queued + 1) != cycle_bound(nodes, queued):
            return False  # a fresh plan would play its queue for fewer cycles
        priority, place = job.spec.priority, self.places[job.spec.priority]
        cycle = self.cycles[place].fork()
        step = cycle.run([job], grow=False)
        if any(a.job_id == job.job_id for a in step.admissions) or (
                step.reservation is not None and step.reservation.job_id == job.job_id):
            return False
        unplaceable = job.job_id in step.unplaceable
        behind = {p for p in self.places if PRIORITY_RANK[p] >= PRIORITY_RANK[priority]}
        cycles: dict[int, Cycle] = {}
        for p, old in self.places.items():
            if p not in behind:
                cycles[old] = self.cycles[old]
            elif old == place:
                cycles[old + 1] = cycle
            else:  # past the job: as it was, but for knowing the job never blocks anyone
                cycles[old + 1] = later = self.cycles[old].fork()
                if unplaceable:
                    later.unplaceable.append(job.job_id)
        self.ahead = {new: self.ahead[old] + (p in behind and not unplaceable)
                      for p, old in self.places.items() for new in [old + (p in behind)]}
        self.places = {p: old + (p in behind) for p, old in self.places.items()}
        self.cycles = cycles
        if unplaceable:
            self.decision = replace(self.decision, unplaceable=[*self.decision.unplaceable, job.job_id])
        queue = self.inputs.queue
        self.inputs = replace(self.inputs, queue=[*queue[:place], job, *queue[place:]],
                              jobs={**self.inputs.jobs, job.job_id: facts})
        likely = None if likely_seconds is None else math.ceil(likely_seconds)
        if likely is not None and likely != job.duration_seconds:
            if self.expected.empty:
                self._likely = None  # the likely plan was the latest one: played on its own from now on
            self.expected = replace(self.expected, seconds={**self.expected.seconds, job.job_id: likely})
        if self._latest is not None:
            self._latest.join(job)
        if self._likely is not None and self._likely is not self._latest:
            self._likely.join(job, self.expected.seconds.get(job.job_id))
        return True

    def latest(self) -> Playthrough:
        if self._latest is None:
            self._latest = playthrough(self.inputs.queue, self.inputs.nodes, self.inputs.flavors,
                                       running=self.inputs.running, now=self.now)
        return self._latest

    def likely(self) -> Playthrough:
        if self.expected.empty:
            return self.latest()
        if self._likely is None:
            self._likely = playthrough(self.inputs.queue, self.inputs.nodes, self.inputs.flavors,
                                       running=self.inputs.running, now=self.now, expected=self.expected)
        return self._likely
