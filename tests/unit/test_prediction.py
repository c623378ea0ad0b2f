"""S6: queue prediction before a job is created: starts now, or queues with a position and an estimate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, Resources
from libs.contracts.events import EventEnvelope, JobPredicted, JobSubmitted, JobSucceeded
from libs.contracts.jobspec import PRIORITY_RANK, JobSpec, Priority
from libs.contracts.scheduling import Prediction
from libs.placement import NodeCapacity, QueuedJob, RunningJob, eligible, holdings, schedule
from services.scheduler.planning import playthrough
from services.scheduler.planning.backfill_plan import Plan, Planner
from services.scheduler.planning.expected import Expected
from services.scheduler.planning.prediction import (
    forecast,
    plan_queue,
    predict,
    predict_queue,
)
from services.scheduler.planning.prediction_cache import PlanInputs, PredictionCache
from services.scheduler.planning.runtime_model import JobRecord, RuntimeModel, Traits, expected_runtimes
from services.scheduler.planning.simulation import insertion_index
from services.scheduler.planning.thread import PlanningThread
from tests.support.placement import (
    FLAVORS,
    NOW,
    admitted,
    busy,
    elastic_spec,
    node,
    queued,
    run_on,
    spec,
)
from tests.support.runtime_model import GatedModel
from tests.support.strategies import SETTINGS, Scenario, job_specs, scenarios


def at(seconds: int) -> datetime:
    return NOW + timedelta(seconds=seconds)


def three_busy_nodes() -> tuple[list[NodeCapacity], list[RunningJob]]:
    """a frees up in 10 minutes, b in 20, c holds a job without a duration limit."""
    nodes = [node(n, cpus=4) for n in "abc"]
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=1200), run_on("r3", ["c"])]
    return busy(nodes, running), running


def test_a_job_that_fits_starts_now() -> None:
    prediction = predict(spec(2), [], [node("a"), node("b")], FLAVORS, now=NOW)
    assert prediction.starts_now
    assert (prediction.flavor, sorted(prediction.nodes), prediction.node_count) == ("cpu-4", ["a", "b"], 2)
    assert prediction.position is None and prediction.estimated_start is None
    assert prediction.predicted_at == NOW
    assert "Starts now" in prediction.reason


def test_any_flavor_that_fits_makes_it_start_now() -> None:
    prediction = predict(spec(1, ["gpu-8", "cpu-4"]), [], [node("a")], FLAVORS, now=NOW)
    assert prediction.starts_now and prediction.flavor == "cpu-4"


def test_an_elastic_job_may_start_now_on_fewer_nodes() -> None:
    nodes = [node(n, cpus=4, pools=["p"]) for n in "ab"]
    prediction = predict(elastic_spec(4, 2, pool="p"), [], nodes, FLAVORS, now=NOW)
    assert prediction.starts_now and prediction.node_count == 2


def test_a_queued_job_gets_its_position_behind_jobs_of_equal_or_higher_priority() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("urgent-1", priority="urgent"), queued("normal-1"), queued("normal-2")]
    normal = predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW)
    assert (normal.starts_now, normal.position, normal.jobs_ahead) == (False, 4, 3)
    urgent = predict(spec(1, priority="urgent"), queue, nodes, FLAVORS, running=running, now=NOW)
    assert (urgent.position, urgent.jobs_ahead) == (2, 1)
    very = predict(spec(1, priority="very-urgent"), queue, nodes, FLAVORS, running=running, now=NOW)
    assert (very.position, very.jobs_ahead) == (1, 0)


def test_the_estimate_is_when_the_job_that_frees_its_node_ends() -> None:
    nodes, running = three_busy_nodes()
    prediction = predict(spec(1), [], nodes, FLAVORS, running=running, now=NOW)
    assert not prediction.starts_now
    assert prediction.estimated_start == at(600)
    assert prediction.flavor == "cpu-4" and prediction.node_count == 1
    assert prediction.reason == "First in line; expected to start at 09:10 UTC when r1 ends."


def test_the_estimate_counts_the_jobs_ahead_and_their_duration_limits() -> None:
    nodes, running = three_busy_nodes()
    # job-1 takes a and b at 09:20 (when r2 ends) for 10 minutes; the new job gets one of them at 09:30.
    queue = [queued("job-1", 2, duration=600), queued("job-2", duration=3600)]
    prediction = predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW)
    assert (prediction.position, prediction.estimated_start) == (3, at(1800))
    assert prediction.reason == "Waits behind 2 jobs; expected to start at 09:30 UTC when job-1 ends."


def test_the_estimate_is_unknown_when_it_waits_for_a_job_without_a_duration_limit() -> None:
    nodes, running = three_busy_nodes()
    prediction = predict(spec(3), [], nodes, FLAVORS, running=running, now=NOW)
    assert not prediction.starts_now and prediction.estimated_start is None
    assert "cannot be estimated" in prediction.reason and "r3" in prediction.reason


def test_the_estimate_is_unknown_behind_a_job_whose_start_is_unknown() -> None:
    nodes, running = three_busy_nodes()
    prediction = predict(spec(1), [queued("stuck", 3)], nodes, FLAVORS, running=running, now=NOW)
    assert prediction.estimated_start is None
    assert "stuck" in prediction.reason


def test_a_job_that_fits_on_no_node_is_said_so() -> None:
    prediction = predict(spec(1, ["gpu-8"]), [], [node("a")], FLAVORS, now=NOW)
    assert not prediction.starts_now and prediction.estimated_start is None
    assert prediction.reason.startswith("Fits on no node of this cluster")


def test_jobs_that_fit_nowhere_are_not_counted_as_ahead() -> None:
    nodes, running = three_busy_nodes()
    prediction = predict(spec(1), [queued("huge", 9)], nodes, FLAVORS, running=running, now=NOW)
    assert (prediction.position, prediction.jobs_ahead) == (1, 0)


def test_a_short_duration_limit_lets_a_job_start_in_a_gap() -> None:
    # The head waits for a (an hour); b is free until then. The spec's own duration is the default.
    running = [run_on("r", ["a"], ends_in=3600)]
    nodes = busy([node(n, cpus=4) for n in "ab"], running)
    queue = [queued("head", 2)]
    assert predict(spec(1, duration="30m"), queue, nodes, FLAVORS, running=running, now=NOW).starts_now
    assert not predict(spec(1, duration="2h"), queue, nodes, FLAVORS, running=running, now=NOW).starts_now
    assert not predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW).starts_now
    assert predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW, duration_seconds=600).starts_now


def test_prediction_leaves_the_queue_alone() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("job-1")]
    predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW)
    assert [j.job_id for j in queue] == ["job-1"]


def test_every_queued_job_gets_a_planned_start() -> None:
    nodes, running = three_busy_nodes()
    queue = [QueuedJob("first", spec(1), 600), QueuedJob("second", spec(2), 600), QueuedJob("never", spec(9)),
             QueuedJob("last", spec(1))]
    assert predict_queue(queue, nodes, FLAVORS, running=running, now=NOW) == {
        "first": at(600), "second": at(1200), "never": None, "last": at(1800)}


def test_planned_starts_include_the_jobs_that_start_now() -> None:
    plans = predict_queue([queued("now"), queued("later")], [node("a", cpus=4)], FLAVORS, now=NOW)
    assert plans == {"now": NOW, "later": None}


def test_jobs_behind_a_job_of_unknown_start_are_planned_around_the_nodes_it_waits_for() -> None:
    nodes, running = three_busy_nodes()
    # "stuck" needs b and c, and c never frees up: b is kept for it, so the new job waits for a.
    queue = [queued("stuck", 2, node_names=["b", "c"])]
    prediction = predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW)
    assert prediction.estimated_start == at(600)
    assert predict_queue(queue, nodes, FLAVORS, running=running, now=NOW) == {"stuck": None}


# --- the likely start: jobs end when jobs like them usually end ------------------------------------------


def test_the_likely_start_counts_on_jobs_ending_before_their_limits() -> None:
    nodes, running = three_busy_nodes()
    result = forecast(spec(1), [], nodes, FLAVORS, running=running, now=NOW, expected=Expected(ends={"r1": at(300)}))
    assert (result.prediction.estimated_start, result.latest_start) == (at(300), at(600))
    assert result.prediction.latest_start == at(600)  # the bound reaches the caller, not only the text
    assert result.prediction.reason == ("First in line; expected to start around 09:05 UTC, going by how long "
                                        "similar jobs ran; by 09:10 UTC when r1 ends if jobs run to their "
                                        "duration limits.")


def test_a_likely_end_of_a_job_without_a_limit_gives_an_estimate_but_no_latest_start() -> None:
    nodes, running = three_busy_nodes()
    result = forecast(spec(3), [], nodes, FLAVORS, running=running, now=NOW, expected=Expected(ends={"r3": at(900)}))
    assert (result.prediction.estimated_start, result.latest_start) == (at(1200), None)
    assert "no later start can be promised as it waits for r3, which has no duration limit" in result.prediction.reason


def test_queued_jobs_are_planned_with_their_likely_runtimes() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("job-1", 2, duration=600), queued("job-2", duration=3600)]
    result = forecast(spec(1), queue, nodes, FLAVORS, running=running, now=NOW,
                      expected=Expected(seconds={"job-1": 60}))
    assert (result.prediction.estimated_start, result.latest_start) == (at(1260), at(1800))


def test_without_likely_runtimes_the_estimate_is_the_latest_start() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("job-1", 2, duration=600)]
    plain = predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW)
    result = forecast(spec(1), queue, nodes, FLAVORS, running=running, now=NOW, expected=Expected())
    assert result.prediction == plain and result.latest_start == plain.estimated_start


# --- the cache: the same answers from a plan kept between state changes ----------------------------------


@dataclass
class Record:
    """A job as the runtime model reads it."""

    spec: JobSpec
    creator: str = "ann"
    flavor: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    duration_seconds: int | None = None


PRIORITIES: list[Priority] = ["very-urgent", "urgent", "normal"]


@st.composite
def cache_cases(draw: st.DrawFn) -> tuple[PlanInputs, RuntimeModel, list[tuple[JobSpec, int | None]]]:
    """A random cluster, queue of mixed priorities, history of finished jobs, and jobs to predict."""
    scenario = draw(scenarios())
    names = [n.info.name for n in scenario.nodes]

    def prioritized(job_spec: JobSpec) -> JobSpec:
        return msgspec.structs.replace(job_spec, priority=draw(st.sampled_from(PRIORITIES)))

    queue = sorted((replace(job, spec=prioritized(job.spec)) for job in scenario.queue),
                   key=lambda job: PRIORITY_RANK[job.spec.priority])
    jobs: dict[str, JobRecord] = {job.job_id: Record(job.spec, duration_seconds=job.duration_seconds)
                                  for job in queue}
    for job in scenario.running:
        limit = draw(st.sampled_from([600, 3600])) if job.ends_at is not None else None
        started = job.ends_at - timedelta(seconds=limit) if job.ends_at is not None and limit else at(-600)
        jobs[job.job_id] = Record(job.spec, flavor=job.flavor.name, started_at=started, duration_seconds=limit)
    model = RuntimeModel(min_samples=1)
    for limited, share in draw(st.lists(st.tuples(st.booleans(), st.floats(0.05, 1.0)), max_size=6)):
        traits = Traits(creator="ann", project="default", kind="j", flavor="f0", nodes=1)
        model.observe(traits, 3600 if limited else None, share * 3600)
    # Mostly plain jobs of a known flavor, which rarely fit nowhere.
    plain = st.builds(lambda nodes, flavor: spec(nodes, [flavor]), st.integers(1, 4),
                      st.sampled_from(sorted(scenario.flavors)))
    probes = [(prioritized(draw(st.one_of(plain, plain, job_specs(sorted(scenario.flavors), names)))),
               draw(st.sampled_from([None, 60, 600, 7200]))) for _ in range(draw(st.integers(1, 4)))]
    inputs = PlanInputs(queue=queue, nodes=scenario.nodes, flavors=scenario.flavors, running=scenario.running,
                        jobs=jobs)
    return inputs, model, probes


def check_as_planned_afresh(cache: PredictionCache, model: RuntimeModel, inputs: PlanInputs, job_spec: JobSpec,
                            seconds: int | None) -> None:
    cached = cache.forecast(job_spec, now=NOW, inputs=lambda: inputs, duration_seconds=seconds)
    fresh = forecast(job_spec, inputs.queue, inputs.nodes, inputs.flavors, running=inputs.running, now=NOW,
                     duration_seconds=seconds,
                     expected=expected_runtimes(model, inputs.queue, inputs.running, inputs.jobs, NOW))
    assert cached == fresh


@pytest.fixture(params=["exact", "bounded", "deep", "rough"])
def bound(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Playthroughs as they are, or bounded to a cycle or two, past which the conservative plan goes on (by the nodes,
    or by the waiting jobs: 4 cycles with one waiting, 2 with two, 1 with more, so that a job submitted changes the
    bound); and that plan bounded to one job, past which the rest is poured (fluid_plan.py)."""
    if request.param in ("bounded", "rough"):
        monkeypatch.setattr(playthrough, "SIMULATION_NODE_CYCLES", 2)
    if request.param == "deep":
        monkeypatch.setattr(playthrough, "SIMULATION_JOB_CYCLES", 4)
    if request.param == "rough":
        monkeypatch.setattr(playthrough, "HORIZON_NODE_JOBS", 1)


# The bound is the same for every example of a test: a function-scoped fixture is right here.
BOUNDED = settings(SETTINGS, max_examples=300,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@BOUNDED
@given(cache_cases())
def test_the_cache_answers_as_a_plan_made_for_each_prediction_does(
        bound: None, case: tuple[PlanInputs, RuntimeModel, list[tuple[JobSpec, int | None]]]) -> None:
    inputs, model, probes = case
    cache = PredictionCache(model)
    for job_spec, seconds in probes:
        check_as_planned_afresh(cache, model, inputs, job_spec, seconds)


@BOUNDED
@given(cache_cases(), st.data())
def test_jobs_submitted_after_a_prediction_are_taken_into_the_plan(
        bound: None, case: tuple[PlanInputs, RuntimeModel, list[tuple[JobSpec, int | None]]],
        data: st.DataObject) -> None:
    current, model, probes = case
    cache = PredictionCache(model)
    for index, (job_spec, seconds) in enumerate(probes):
        check_as_planned_afresh(cache, model, current, *data.draw(st.sampled_from(probes)))
        # The job is submitted: it joins the queue behind the jobs of its priority or higher.
        job_id, place = f"new-{index}", insertion_index(current.queue, job_spec.priority)
        record = Record(job_spec, creator=data.draw(st.sampled_from(["ann", "bob"])), duration_seconds=seconds)
        current = replace(current, queue=[*current.queue[:place], QueuedJob(job_id, job_spec, seconds),
                                          *current.queue[place:]], jobs={**current.jobs, job_id: record})
        cache.applied(envelope(JobSubmitted(job_id=job_id, spec=job_spec, creator=record.creator)), current.jobs)
    check_as_planned_afresh(cache, model, current, *data.draw(st.sampled_from(probes)))


def envelope(event: JobSucceeded | JobPredicted | JobSubmitted) -> EventEnvelope:
    return EventEnvelope(event_id="e1", service="scheduler", aggregate_type="job", aggregate_id=event.job_id,
                         version=1, position=1, recorded_at=NOW, event=event)


def test_the_cache_plans_again_after_a_state_change_or_when_its_plan_is_old() -> None:
    nodes, running = three_busy_nodes()
    made: list[int] = []

    def inputs() -> PlanInputs:
        made.append(1)
        return PlanInputs(queue=[], nodes=nodes, flavors=FLAVORS, running=running)

    cache = PredictionCache(max_age=timedelta(seconds=30))
    first = cache.predict(spec(1), now=NOW, inputs=inputs)
    assert cache.predict(spec(1), now=at(20), inputs=inputs) == first and len(made) == 1
    cache.applied(envelope(JobPredicted(job_id="job-1", prediction=first)), {})  # changes nothing planned
    assert cache.predict(spec(1), now=at(20), inputs=inputs).predicted_at == NOW and len(made) == 1
    cache.applied(envelope(JobSucceeded(job_id="r1")), {})
    assert cache.predict(spec(1), now=at(20), inputs=inputs).predicted_at == at(20) and len(made) == 2
    assert cache.predict(spec(1), now=at(60), inputs=inputs).predicted_at == at(60) and len(made) == 3


def test_the_cache_learns_from_jobs_that_end() -> None:
    cache = PredictionCache(RuntimeModel(min_samples=1))
    job_spec = spec(1, duration="1h")
    ended = Record(job_spec, flavor="cpu-4", started_at=NOW, ended_at=at(900), duration_seconds=3600)
    cache.applied(envelope(JobSucceeded(job_id="job-1")), {"job-1": ended})
    assert cache.runtimes.runtime(Traits.of(job_spec, "ann"), 3600) == 900


# --- the cache in a worker thread: the event loop goes on while a plan is made ------------------------------


def two_node_queue() -> PlanInputs:
    """a frees up in 10 minutes, b in 20, c never; job-1 needs two nodes for up to an hour."""
    nodes, running = three_busy_nodes()
    return PlanInputs(queue=[queued("job-1", 2, duration=3600)], nodes=nodes, flavors=FLAVORS, running=running,
                      jobs={"job-1": Record(spec(2), duration_seconds=3600)})


def fresh(inputs: PlanInputs, model: RuntimeModel, job_spec: JobSpec, now: datetime) -> Prediction:
    return forecast(job_spec, inputs.queue, inputs.nodes, inputs.flavors, running=inputs.running, now=now,
                    expected=expected_runtimes(model, inputs.queue, inputs.running, inputs.jobs, now)).prediction


async def test_a_job_that_ends_while_a_thread_plans_teaches_the_model_once_the_plan_is_made() -> None:
    inputs = two_node_queue()
    model = GatedModel()
    cache = PredictionCache(model)
    planning = PlanningThread(cache)
    model.armed = True
    first = asyncio.create_task(planning.forecast(spec(1), clock=lambda: NOW, inputs=lambda: inputs))
    await model.planning()
    # Meanwhile the loop folds an end: a job like job-1 that ran 10 minutes of its hour.
    ended = Record(spec(2), flavor="cpu-4", started_at=at(-3600), ended_at=at(-3000), duration_seconds=3600)
    cache.applied(envelope(JobSucceeded(job_id="old")), {"old": ended})
    assert model.observed == 0  # not while the thread reads the model
    model.released.set()
    assert (await first).prediction == fresh(inputs, RuntimeModel(), spec(1), NOW)
    assert (await first).prediction.estimated_start == at(4800)  # job-1 runs its hour on a and b
    assert model.observed == 1
    second = await planning.forecast(spec(1), clock=lambda: at(10), inputs=lambda: inputs)
    assert second.prediction == fresh(inputs, model, spec(1), at(10))
    assert (second.prediction.predicted_at, second.prediction.estimated_start) == (at(10), at(1800))


async def test_jobs_submitted_while_a_thread_plans_are_taken_into_the_kept_plan() -> None:
    inputs = two_node_queue()
    model = GatedModel()
    cache = PredictionCache(model)
    planning = PlanningThread(cache)
    made: list[PlanInputs] = []

    def current() -> PlanInputs:
        made.append(inputs)
        return made[-1]

    model.armed = True
    first = asyncio.create_task(planning.forecast(spec(1), clock=lambda: NOW, inputs=current))
    await model.planning()
    record = Record(spec(1), creator="bob", duration_seconds=600)
    later = replace(inputs, queue=[*inputs.queue, QueuedJob("job-2", spec(1), 600)],
                    jobs={**inputs.jobs, "job-2": record})
    cache.applied(envelope(JobSubmitted(job_id="job-2", spec=spec(1), creator="bob")), later.jobs)
    model.released.set()
    assert (await first).prediction == fresh(inputs, model, spec(1), NOW)  # as of when it was planned
    second = await planning.forecast(spec(1), clock=lambda: at(5), inputs=current)
    assert second.prediction == fresh(later, model, spec(1), NOW)  # job-2 counted, from the kept plan
    assert second.prediction.jobs_ahead == 2 and len(made) == 1


async def test_a_prediction_given_up_while_its_thread_plans_leaves_the_cache_usable() -> None:
    inputs = two_node_queue()
    model = GatedModel()
    cache = PredictionCache(model)
    planning = PlanningThread(cache)
    model.armed = True
    abandoned = asyncio.create_task(planning.forecast(spec(1), clock=lambda: NOW, inputs=lambda: inputs))
    await model.planning()
    abandoned.cancel()
    await asyncio.gather(abandoned, return_exceptions=True)
    assert abandoned.cancelled()
    waiting = asyncio.create_task(planning.forecast(spec(3), clock=lambda: NOW, inputs=lambda: inputs))
    model.released.set()
    assert (await waiting).prediction == fresh(inputs, model, spec(3), NOW)


# --- backfill in the plan: jobs planned into gaps ahead of the jobs before them ---------------------------


def two_nodes_freeing_apart() -> tuple[list[NodeCapacity], list[RunningJob]]:
    """a frees up in 10 minutes, b in an hour."""
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=3600)]
    return busy([node(n, cpus=4) for n in "ab"], running), running


def test_a_short_job_is_planned_into_the_gap_ahead_of_a_big_one() -> None:
    nodes, running = two_nodes_freeing_apart()
    # "big" needs a and b, from 10:00; a is idle from 09:10 until then.
    queue = [queued("big", 2, duration=3600), queued("short", duration=1800), queued("long", duration=7200)]
    plans = plan_queue(queue, nodes, FLAVORS, running=running, now=NOW)
    assert {job_id: plan.start for job_id, plan in plans.items()} == {
        "big": at(3600), "short": at(600), "long": at(7200)}
    assert [p.node for p in plans["short"].placement] == ["a"] and plans["short"].waits_for == ["r1"]
    prediction = predict(spec(1), queue[:1], nodes, FLAVORS, running=running, now=NOW, duration_seconds=1800)
    assert prediction.estimated_start == at(600) and (prediction.position, prediction.jobs_ahead) == (2, 1)
    assert prediction.reason == "Waits behind 1 job; expected to start at 09:10 UTC when r1 ends."


def test_a_gap_is_used_only_by_a_job_that_ends_before_what_is_planned_after_it() -> None:
    nodes, running = two_nodes_freeing_apart()
    queue = [queued("big", 2, duration=3600)]
    # 50 minutes of the gap's 50 fit; a minute more, or no limit at all, and it waits for "big" to end.
    for seconds, start in ((3000, 600), (3060, 7200), (None, 7200)):
        prediction = predict(spec(1), queue, nodes, FLAVORS, running=running, now=NOW, duration_seconds=seconds)
        assert prediction.estimated_start == at(start), seconds


def test_a_job_in_a_gap_delays_no_job_planned_before_it() -> None:
    nodes, running = two_nodes_freeing_apart()
    big = [queued("big", 2, duration=3600)]
    alone = plan_queue(big, nodes, FLAVORS, running=running, now=NOW)["big"]
    plans = plan_queue([*big, queued("short", duration=1800), queued("short-2", duration=1200)], nodes, FLAVORS,
                       running=running, now=NOW)
    assert (plans["big"].start, plans["big"].placement) == (alone.start, alone.placement)
    # The gap on a (50 minutes) holds the first short job (30); the second (20) fits in what is left.
    assert (plans["short"].start, plans["short-2"].start) == (at(600), at(2400))


def test_the_likely_plan_backfills_into_gaps_that_early_ends_open() -> None:
    nodes, running = two_nodes_freeing_apart()
    queue = [queued("big", 2, duration=3600)]
    # By their limits a is free for 50 minutes before "big"; r1 likely ends at 09:05, so for 55 in the
    # likely plan: a 55-minute job fits there only in the likely plan.
    result = forecast(spec(1), queue, nodes, FLAVORS, running=running, now=NOW, duration_seconds=3300,
                      expected=Expected(ends={"r1": at(300)}))
    assert (result.prediction.estimated_start, result.latest_start) == (at(300), at(7200))


def test_a_multi_node_job_is_planned_where_all_its_nodes_are_free_together() -> None:
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=1200), run_on("r3", ["c"], ends_in=600),
               run_on("r4", ["d"], ends_in=7200)]
    nodes = busy([node(n, cpus=4) for n in "abcd"], running)
    # "all" waits for d; a and c are idle from 09:10, b from 09:20, all three until 11:00.
    queue = [queued("all", 4, duration=3600), queued("pair", 2, duration=3600), queued("trio", 3, duration=3600)]
    plans = plan_queue(queue, nodes, FLAVORS, running=running, now=NOW)
    assert {job_id: plan.start for job_id, plan in plans.items()} == {"all": at(7200), "pair": at(600),
                                                                      "trio": at(10_800)}
    assert sorted(p.node for p in plans["pair"].placement) == ["a", "c"]


def test_a_gap_before_a_job_without_a_limit_takes_the_nodes_for_good_still_gives_an_estimate() -> None:
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=1200)]
    nodes = busy([node(n, cpus=4) for n in "ab"], running)
    # "forever" holds a and b from 09:20 on; a is idle from 09:10 until then.
    queue = [queued("forever", 2), queued("short", duration=300), queued("long", duration=900)]
    plans = plan_queue(queue, nodes, FLAVORS, running=running, now=NOW, until="long")
    assert (plans["forever"].start, plans["short"].start, plans["long"].start) == (at(1200), at(600), None)
    assert plans["long"].waits_for == ["forever"]


def test_a_fork_plans_apart_from_its_original() -> None:
    nodes, running = two_nodes_freeing_apart()
    queue = [queued("big", 2, duration=3600), queued("short", duration=1800)]
    planner = Planner(nodes, FLAVORS, running, NOW, schedule(queue, nodes, FLAVORS, running=running, now=NOW),
                      queue, None)
    planner.plan(queue[:1])
    twin = planner.fork()
    assert twin.plan_job(queue[1]).start == at(600)  # into the gap on a
    # The original never saw "short": the gap is still free there, and the fork keeps its own plan.
    assert planner.plan_job(queued("other", duration=3000)).start == at(600)
    assert twin.plan_job(queued("other", duration=3000)).start == at(7200)


@dataclass(frozen=True)
class Use:
    """A stretch of time in which a job holds resources on a node."""

    start: datetime
    end: datetime | None
    held: Resources


def uses(scenario: Scenario, plans: dict[str, Plan], queue: list[QueuedJob]) -> dict[str, list[Use]]:
    """Per node, what running and planned jobs hold, and when."""
    durations = {job.job_id: job.duration_seconds for job in queue}
    found: dict[str, list[Use]] = {n.info.name: [] for n in scenario.nodes}
    for job in scenario.running:
        if job.ends_at is not None:  # free from its end on: the nodes' free amounts count it as held now
            for name, amount in holdings(job.placement, job.flavor).items():
                found[name].append(Use(max(job.ends_at, NOW), None, Resources() - amount))
    for job_id, plan in plans.items():
        if plan.start is None or plan.flavor is None:
            continue
        seconds = durations[job_id]
        end = None if seconds is None else plan.start + timedelta(seconds=seconds)
        for name, amount in holdings(plan.placement, scenario.flavors[plan.flavor]).items():
            found[name].append(Use(plan.start, end, amount))
    return found


def free_at(scenario: Scenario, found: dict[str, list[Use]], name: str, moment: datetime) -> Resources:
    free = next(n.free for n in scenario.nodes if n.info.name == name)
    for use in found[name]:
        if use.start <= moment and (use.end is None or moment < use.end):
            free = free - use.held
    return free


def likely(scenario: Scenario, data: st.DataObject) -> tuple[list[QueuedJob], list[RunningJob]]:
    """The scenario with random likely runtimes: running jobs end earlier (or, without a limit, at some
    point), queued jobs run shorter."""
    ends = {job.job_id: NOW + timedelta(seconds=data.draw(st.sampled_from([0, 120, 900, 2400])))
            for job in scenario.running if data.draw(st.booleans())}
    seconds = {job.job_id: data.draw(st.sampled_from([30, 240, 1200])) for job in scenario.queue
               if data.draw(st.booleans())}
    expected = Expected(ends=ends, seconds=seconds)
    return expected.queue(scenario.queue), expected.running(scenario.running)


def conservative_plan(queue: list[QueuedJob], nodes: list[NodeCapacity], flavors: dict[str, Flavor], *,
                      running: list[RunningJob], now: datetime) -> dict[str, Plan]:
    """The conservative backfill plan of the whole queue (it plans past what a playthrough may look at)."""
    decision = schedule(queue, nodes, flavors, running=running, now=now)
    return Planner(nodes, flavors, running, now, decision, queue, None).plan(queue)


@settings(SETTINGS, max_examples=300)
@given(scenarios(), st.data())
def test_planned_jobs_never_overcommit_a_node_at_any_time(scenario: Scenario, data: st.DataObject) -> None:
    queue, running = likely(scenario, data) if data.draw(st.booleans()) else (scenario.queue, scenario.running)
    running = [replace(job, can_grow=False) for job in running]  # growth is not played
    scenario = replace(scenario, queue=queue, running=running)
    plan = data.draw(st.sampled_from([plan_queue, conservative_plan]))
    plans = plan(queue, scenario.nodes, scenario.flavors, running=running, now=NOW)
    found = uses(scenario, plans, queue)
    for name, stretches in found.items():
        for moment in {NOW, *(use.start for use in stretches)}:
            free = free_at(scenario, found, name, moment)
            assert free.cpus >= -1e-9 and free.memory_mib >= 0 and free.accelerators >= 0, (name, moment)


@settings(SETTINGS, max_examples=300)
@given(scenarios(), st.data())
def test_a_one_rank_job_is_planned_conservatively_at_the_earliest_time_it_fits_around_the_jobs_before_it(
        scenario: Scenario, data: st.DataObject) -> None:
    flavor = data.draw(st.sampled_from(sorted(scenario.flavors)))
    seconds = data.draw(st.sampled_from([None, 60, 600, 3600]))
    queue = [*scenario.queue, QueuedJob("one", spec(1, [flavor]), seconds)]
    plans = conservative_plan(queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW)
    ahead = {job_id: plan for job_id, plan in plans.items() if job_id != "one"}
    assume(all(plan.start is not None or plan.unplaceable for plan in ahead.values()))  # no nodes set aside
    found = uses(scenario, ahead, queue)
    need = Resources.of_flavor(scenario.flavors[flavor])
    moments = sorted({NOW, *(u.start for stretch in found.values() for u in stretch),
                      *(u.end for stretch in found.values() for u in stretch if u.end is not None)})
    moments = [moment for moment in moments if moment >= NOW]

    def fits(name: str, start: datetime) -> bool:
        end = None if seconds is None else start + timedelta(seconds=seconds)
        return all(need.fits_in(free_at(scenario, found, name, moment))
                   for moment in [start, *(m for m in moments if m > start and (end is None or m < end))])

    job_spec = queue[-1].spec
    assume("one" not in admitted(schedule(queue, scenario.nodes, scenario.flavors, running=scenario.running,
                                          now=NOW)))  # started now, ahead of the plans of the jobs before it
    eligible_nodes = [n.info.name for n in scenario.nodes if eligible(n.info, job_spec, scenario.flavors[flavor])]
    earliest = next((moment for moment in moments if any(fits(name, moment) for name in eligible_nodes)), None)
    assert plans["one"].start == earliest


def test_a_job_that_fits_nowhere_submitted_once_the_queue_was_played_out_holds_back_no_one() -> None:
    """A kept playthrough that has run to its end takes in a job that fits on no node as a fresh one would: no job
    behind it is said to wait for it."""
    nodes, running = three_busy_nodes()  # c is held for good by r3
    stuck, huge, mine = queued("stuck", 3), queued("huge", 4), queued("mine", 1)  # "huge": more nodes than there are
    play = playthrough.Playthrough(nodes, FLAVORS, running=running, queue=[stuck], now=NOW)
    assert play.new_job(mine).behind == ["stuck"]  # played to its end: nothing more happens
    play.join(huge)
    fresh = playthrough.Playthrough(nodes, FLAVORS, running=running, queue=[stuck, huge], now=NOW).new_job(mine)
    assert play.new_job(mine) == fresh
    assert fresh.behind == ["stuck"]
