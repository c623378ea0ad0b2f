"""S6: queue prediction before a job is created: starts now, or queues with a position and an estimate."""

from __future__ import annotations

from datetime import datetime, timedelta

from services.scheduler.placement import NodeCapacity, QueuedJob, RunningJob
from services.scheduler.prediction import predict, predict_queue
from tests.unit.test_placement import (
    FLAVORS,
    NOW,
    busy,
    elastic_spec,
    node,
    queued,
    run_on,
    spec,
)


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
