"""Queue prediction (SPEC S6): would a job start now, and if not, when it would start.

A job starts now when this cycle would start it. Otherwise its start is found by playing the scheduler's own
cycles forward in virtual time (playthrough.py, simulation.py): at every instant a job ends, the cycle the
scheduler would run then. It is played twice:

- the *latest* start: every job runs to its duration limit; a job without a limit holds its nodes for good,
  so a job that waits for such nodes has no estimate;
- the *likely* start (`Expected`): each job ends when jobs like it usually end (runtime_model.py), while the
  scheduler still decides on the limits; that is what `estimated_start` says when it is known.

When every job runs to its limit and nothing else happens (no later submissions, priority changes or
faults), the latest start is exact: it is the instant the scheduler starts the job. Past the work a
playthrough is allowed, the rest of the queue is planned by conservative backfill (backfill_plan.py), and past
the jobs that plan places one by one, roughly (fluid_plan.py; the reason says so).
`PredictionCache` (prediction_cache.py) answers the same as `forecast` without playing the queue again for
every question.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from libs.contracts.cluster import Flavor
from libs.contracts.events import Placement
from libs.contracts.jobspec import JobSpec
from libs.contracts.scheduling import Prediction
from libs.placement import (
    Admission,
    NodeCapacity,
    QueuedJob,
    RunningJob,
    schedule,
)
from services.scheduler.planning.backfill_plan import Plan
from services.scheduler.planning.expected import Expected
from services.scheduler.planning.playthrough import Playthrough
from services.scheduler.planning.simulation import insertion_index

ROUGH = "a rough estimate this deep in the queue"
NEW_JOB = "(new job)"  # the id a predicted job gets; real job ids look like job-<12 hex digits>


@dataclass(frozen=True)
class Forecast:
    """A prediction, and the start it would have if every job ran to its duration limit."""

    prediction: Prediction
    latest_start: datetime | None = None
    expectation: str = ""  # a waiting job's `expectation`, for `trainyard why` to tell the same


def format_time(moment: datetime, now: datetime) -> str:
    """`14:05 UTC`, with the date when it is not today's."""
    if moment.tzinfo is not None:
        moment, now = moment.astimezone(UTC), now.astimezone(UTC) if now.tzinfo else now
    text = moment.strftime("%H:%M UTC")
    return text if moment.date() == now.date() else f"{moment:%Y-%m-%d} {text}"


def names(ids: Sequence[str], limit: int = 3) -> str:
    """`job-a`, `job-a and job-b`, `job-a, job-b, job-c and 2 more`."""
    shown = list(ids[:limit])
    if len(ids) > limit:
        return f"{', '.join(shown)} and {len(ids) - limit} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def plan_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
               running: Sequence[RunningJob] = (), now: datetime, until: str | None = None,
               expected: Expected | None = None) -> dict[str, Plan]:
    """The plan of every queued job (or of those up to and including `until`): the latest start, or with
    `expected` the likely one."""
    last = next((i for i, job in enumerate(queue) if job.job_id == until), len(queue) - 1)
    return playthrough(queue, nodes, flavors, running=running, now=now,
                       expected=expected).queued([job.job_id for job in queue[:last + 1]])


def playthrough(queue: Sequence[QueuedJob], nodes: Sequence[NodeCapacity], flavors: Mapping[str, Flavor], *,
                running: Sequence[RunningJob] = (), now: datetime, expected: Expected | None = None) -> Playthrough:
    """The queue played forward: every job to its limit, or with `expected` as long as it likely runs."""
    if expected is None or expected.empty:
        return Playthrough(nodes, flavors, running=running, queue=queue, now=now)
    return Playthrough(nodes, flavors, running=running, queue=queue, now=now, ends=expected.ends,
                       runtimes=expected.seconds)


def unknown_start_reason(plan: Plan) -> str:
    """Why a plan has no start, as the end of a sentence."""
    if plan.behind:
        verb = "waits" if len(plan.behind) == 1 else "wait"
        return f"{names(plan.behind)} ahead of it {verb} for jobs without a duration limit"
    if plan.waits_for:
        verb = "has" if len(plan.waits_for) == 1 else "have"
        return f"it waits for {names(plan.waits_for)}, which {verb} no duration limit"
    return "it waits for jobs without a duration limit"


def predict_queue(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
                  running: Sequence[RunningJob] = (), now: datetime) -> dict[str, datetime | None]:
    """The expected start of every queued job (None: unknown, or it fits on no node)."""
    return {job_id: plan.start for job_id, plan in
            plan_queue(queue, nodes, flavors, running=running, now=now).items()}


def predict(spec: JobSpec, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
            running: Sequence[RunningJob] = (), now: datetime, duration_seconds: int | None = None,
            expected: Expected | None = None) -> Prediction:
    """S6: what would happen if `spec` were submitted now (see `forecast`)."""
    return forecast(spec, queue, nodes, flavors, running=running, now=now, duration_seconds=duration_seconds,
                    expected=expected).prediction


def forecast(spec: JobSpec, queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
             running: Sequence[RunningJob] = (), now: datetime, duration_seconds: int | None = None,
             expected: Expected | None = None) -> Forecast:
    """S6: what would happen if `spec` were submitted now; its likely start from `expected`, its latest
    from the duration limits.

    The job joins the queue behind every job of the same or a higher priority. Jobs ahead of it that
    this cycle starts, or that fit on no node and so never block anyone, are not counted as ahead.
    """
    if duration_seconds is None:
        duration_seconds = spec.max_duration_seconds
    index = insertion_index(queue, spec.priority)
    job = QueuedJob(NEW_JOB, spec, duration_seconds)
    decision = schedule([*queue[:index], job, *queue[index:]], nodes, flavors, running=running, now=now)
    admitted = {admission.job_id: admission for admission in decision.admissions}
    if (mine := admitted.get(NEW_JOB)) is not None:
        return starts_now(mine, now)
    skipped = set(admitted).union(decision.unplaceable)  # started now, or never blocking it
    jobs_ahead = sum(1 for queued in queue[:index] if queued.job_id not in skipped)
    latest = playthrough(queue, nodes, flavors, running=running, now=now).new_job(job)
    likely = latest
    if expected is not None and not expected.empty:
        likely = playthrough(queue, nodes, flavors, running=running, now=now, expected=expected).new_job(job)
    return waits(spec, now, jobs_ahead, latest, likely)


def forecast_queued(job_ids: Collection[str], queue: list[QueuedJob], nodes: list[NodeCapacity],
                    flavors: dict[str, Flavor], *, running: Sequence[RunningJob] = (), now: datetime,
                    expected: Expected | None = None) -> dict[str, Forecast]:
    """S6 for jobs already queued, played together: when each starts with the queue as it is. Those of
    `job_ids` not in `queue` get none."""
    asked = set(job_ids)
    wanted = {job.job_id for job in queue if job.job_id in asked}
    if not wanted:
        return {}
    decision = schedule(queue, nodes, flavors, running=running, now=now)
    admitted = {admission.job_id: admission for admission in decision.admissions}
    skipped = set(admitted).union(decision.unplaceable)
    waiting = wanted - admitted.keys()
    latest = playthrough(queue, nodes, flavors, running=running, now=now).queued(waiting)
    likely = latest
    if expected is not None and not expected.empty:
        likely = playthrough(queue, nodes, flavors, running=running, now=now, expected=expected).queued(waiting)
    forecasts: dict[str, Forecast] = {}
    ahead = 0
    for job in queue:
        if job.job_id in wanted:
            mine = admitted.get(job.job_id)
            forecasts[job.job_id] = (starts_now(mine, now) if mine is not None else
                                     waits(job.spec, now, ahead, latest[job.job_id], likely[job.job_id]))
            if len(forecasts) == len(wanted):
                break
        ahead += job.job_id not in skipped
    return forecasts


def starts_now(admission: Admission, now: datetime) -> Forecast:
    return started(admission.flavor, admission.placement, now)


def started(flavor: str, placement: Sequence[Placement], at: datetime) -> Forecast:
    """The forecast of a job that starts `at`, with `flavor` on `placement`."""
    hosts = [p.node for p in placement]
    workers = sum(1 for p in placement if p.role == "worker")
    return Forecast(Prediction(
        starts_now=True, flavor=flavor, nodes=hosts, node_count=workers, predicted_at=at,
        reason=f"Starts now with flavor {flavor} on {', '.join(dict.fromkeys(hosts))}."), at)


def waits(spec: JobSpec, now: datetime, jobs_ahead: int, latest: Plan, likely: Plan) -> Forecast:
    """The forecast of a job that queues behind `jobs_ahead` jobs, from its two plans."""
    plan = likely if likely.start is not None else latest
    workers = sum(1 for p in plan.placement if p.role == "worker")
    if latest.unplaceable:
        reason, clause = (f"Fits on no node of this cluster with flavor {', '.join(spec.flavors)}, "
                          "even with every node free."), ""
    else:
        behind = f"Waits behind {jobs_ahead} job{'s' if jobs_ahead != 1 else ''}" if jobs_ahead else "First in line"
        clause = expectation(now, latest, likely)
        reason = f"{behind}; {clause}."
    # The nodes it is planned to start on (D1: its datasets are copied there while it waits).
    return Forecast(Prediction(starts_now=False, flavor=plan.flavor, nodes=[p.node for p in plan.placement],
                               node_count=workers, position=jobs_ahead + 1, jobs_ahead=jobs_ahead,
                               estimated_start=plan.start, predicted_at=now, reason=reason,
                               latest_start=latest.start),
                    latest.start, clause)


def expectation(now: datetime, latest: Plan, likely: Plan) -> str:
    """When a waiting job is expected to start, likely and latest, as a clause: "expected to start at 14:05 UTC
    when job-… ends", "expected to start around 10:40 UTC, going by how long similar jobs ran; by 14:05 UTC …",
    or why it cannot be estimated. A rough plan (deep in the queue, fluid_plan.py) says so, and promises no
    latest start."""
    plan = likely if likely.start is not None else latest
    if plan.start is None:
        return f"its start cannot be estimated because {unknown_start_reason(likely)}"
    rough = f" ({ROUGH})" if plan.rough else ""
    if plan is latest or likely.start == latest.start:
        return f"expected to start {'around' if plan.rough else 'at'} {format_time(plan.start, now)}" \
               f"{_when_ends(plan)}{rough}"
    when = f"expected to start around {format_time(plan.start, now)}, going by how long similar jobs ran{rough}"
    if latest.start is None:
        return f"{when}; no later start can be promised as {unknown_start_reason(latest)}"
    by = "around" if latest.rough else "by"
    return f"{when}; {by} {format_time(latest.start, now)}{_when_ends(latest)} if jobs run to their duration limits"


def _when_ends(plan: Plan) -> str:
    if not plan.waits_for:
        return ""
    return f" when {names(plan.waits_for)} {'ends' if len(plan.waits_for) == 1 else 'end'}"
