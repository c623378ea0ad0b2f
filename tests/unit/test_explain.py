"""`trainyard why JOB`: what a queued job waits for."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from libs.contracts.cluster import Resources
from libs.contracts.scheduling import FlavorWait, NodeShortage
from libs.placement import NodeCapacity, RunningJob
from services.scheduler.planning.expected import Expected
from services.scheduler.planning.explain import explain
from services.scheduler.planning.prediction import forecast_queued
from tests.support.placement import (
    FLAVORS,
    GPU4,
    NOW,
    busy,
    info,
    node,
    queued,
    run_on,
)


def three_busy_nodes() -> tuple[list[NodeCapacity], list[RunningJob]]:
    """a frees up at 09:10, b at 09:20, c holds a job without a duration limit."""
    nodes = [node(n, cpus=4) for n in "abc"]
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=1200), run_on("r3", ["c"])]
    return busy(nodes, running), running


def test_the_head_is_told_its_reservation() -> None:
    nodes, running = three_busy_nodes()
    report = explain("job-1", [queued("job-1", 2)], nodes, FLAVORS, running=running, now=NOW)
    assert (report.status, report.position, report.jobs_ahead, report.jobs_ahead_count) == ("queued", 1, [], 0)
    assert report.head and report.reserved_start == NOW.replace(minute=20)
    assert sorted(report.reserved_nodes) == ["a", "b"]
    assert "Reserved to start at 09:20 UTC on a, b when r2 ends." in report.summary


def test_each_flavor_says_which_nodes_fit_and_what_the_others_lack() -> None:
    nodes, running = three_busy_nodes()
    report = explain("job-1", [queued("job-1", 2)], nodes, FLAVORS, running=running, now=NOW)
    assert report.flavors == [FlavorWait(
        flavor="cpu-4", eligible_nodes=3, fitting_nodes=0, needed_nodes=2,
        shortages=[NodeShortage(node=n, missing=["cpus: 0 free, 4 needed"], held_by=[r])
                   for n, r in (("a", "r1"), ("b", "r2"), ("c", "r3"))])]
    assert ("Waits for 2 more nodes with 4 CPUs and 8192 MiB free for flavor cpu-4: 0 of 3 eligible nodes "
            "fit now.") in report.summary


def test_shortages_name_every_missing_resource() -> None:
    partly = NodeCapacity(info=info("g", cpus=16, gpus=4), free=Resources(cpus=2, memory_mib=1024, accelerators=0))
    report = explain("job-1", [queued("job-1", 1, ["gpu-4"])], [partly], FLAVORS, now=NOW)
    (wait,) = report.flavors
    assert wait.shortages[0].missing == ["cpus: 2 free, 8 needed", "memory: 1024 MiB free, 32768 MiB needed",
                                         "accelerators: 0 free, 4 needed"]


def test_at_most_ten_shortages_are_listed() -> None:
    nodes = [node(f"n{i:02}", cpus=4) for i in range(15)]
    running = [run_on(f"r{i}", [n.info.name]) for i, n in enumerate(nodes)]
    report = explain("job-1", [queued("job-1")], busy(nodes, running), FLAVORS, running=running, now=NOW)
    (wait,) = report.flavors
    assert wait.eligible_nodes == 15 and len(wait.shortages) == 10


def test_jobs_ahead_are_listed_up_to_ten_with_the_full_count() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued(f"job-{i:02}") for i in range(12)] + [queued("mine")]
    report = explain("mine", queue, nodes, FLAVORS, running=running, now=NOW)
    assert (report.position, report.jobs_ahead_count, report.head) == (13, 12, False)
    assert report.jobs_ahead == [f"job-{i:02}" for i in range(10)]
    assert report.summary[0].startswith("Behind 12 jobs of higher or equal priority: job-00, job-01")


def test_a_job_that_fits_now_but_would_delay_the_head_is_told_why() -> None:
    running = [run_on("r", ["a"], ends_in=3600)]
    nodes = busy([node(n, cpus=4) for n in "ab"], running)
    report = explain("small", [queued("head", 2), queued("small")], nodes, FLAVORS, running=running, now=NOW)
    assert report.flavors[0].fitting_nodes == 1
    assert any(s.startswith("Room is free now, but starting it would delay head, reserved to start at 10:00 UTC")
               and "duration limit" in s for s in report.summary)


def test_a_job_that_can_start_now_is_told_so() -> None:
    report = explain("job-1", [queued("job-1")], [node("a")], FLAVORS, now=NOW)
    assert report.summary == ["Can start now: the next scheduling cycle starts it with flavor cpu-4 on a."]


@pytest.mark.parametrize(
    ("extra", "flavor", "note"),
    [
        ({"node_names": ["gone-1", "gone-2"]}, "cpu-4", "pinned to gone-1 and gone-2, and none of them is schedulable"),
        ({"pool": "team-x"}, "cpu-4", "no schedulable node is in pool team-x"),
        ({}, "gpu-8", "no schedulable node has board A100"),
        ({"driver_version": "999"}, "gpu-4", "no schedulable node with board A100 has driver version 999"),
    ],
)
def test_a_flavor_with_no_eligible_node_says_which_restriction_excludes_them(
        extra: dict[str, Any], flavor: str, note: str) -> None:
    nodes = [node("a"), node("m", gpus=8, board="MLU370"), node("g", gpus=4)]
    if flavor == "gpu-8":
        nodes = nodes[:2]
    report = explain("job-1", [queued("job-1", 1, [flavor], **extra)], nodes, FLAVORS, now=NOW)
    (wait,) = report.flavors
    assert (wait.eligible_nodes, wait.note) == (0, note)
    assert report.summary[0] == f"Fits on no node of this cluster: flavor {flavor}: {note}."


def test_a_job_too_big_for_the_cluster_is_told_so() -> None:
    report = explain("big", [queued("big", 3)], [node("a", cpus=4), node("b", cpus=4)], FLAVORS, now=NOW)
    assert report.summary == ["Fits on no node of this cluster: flavor cpu-4: its 2 eligible nodes cannot hold "
                              "3 ranks even when empty."]


def test_an_eligible_node_that_is_lost_is_mentioned() -> None:
    nodes = [node("a", cpus=4)]
    running = [run_on("r", ["a"], ends_in=600)]
    lost = info("g", gpus=4)
    report = explain("job-1", [queued("job-1", 1, ["gpu-4", "cpu-4"])], busy(nodes, running), FLAVORS,
                     running=running, now=NOW, all_nodes=[nodes[0].info, lost])
    gpu = report.flavors[0]
    assert (gpu.flavor, gpu.eligible_nodes) == (GPU4.name, 0)
    assert "g could take it but is lost" in gpu.note
    assert any("g could take it but is lost" in s for s in report.summary)


def test_an_unknown_start_is_explained() -> None:
    nodes, running = three_busy_nodes()
    report = explain("job-1", [queued("job-1", 3)], nodes, FLAVORS, running=running, now=NOW)
    assert report.head and report.reserved_start is None
    assert "Reserved on a, b, c; the start is unknown because r3 has no duration limit." in report.summary


def test_a_job_not_in_the_queue_is_an_error() -> None:
    with pytest.raises(KeyError):
        explain("missing", [], [node("a")], FLAVORS, now=NOW)


def test_a_job_stuck_behind_a_job_of_unknown_start_is_told_which() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("stuck", 3), queued("mine", 1)]  # a and b free up, but "stuck" holds them back
    report = explain("mine", queue, nodes, FLAVORS, running=running, now=NOW)
    assert report.summary[-1] == ("Its start cannot be estimated because stuck ahead of it waits for jobs without "
                                  "a duration limit.")


def test_a_job_that_needs_a_node_held_for_good_is_told_by_whom() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("stuck", 3), queued("mine", 1, node_names=["c"])]
    report = explain("mine", queue, nodes, FLAVORS, running=running, now=NOW)
    assert report.summary[-1] == "Its start cannot be estimated because it waits for r3, which has no duration limit."


def test_a_job_that_waits_gets_an_expected_start() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("stuck", 2, node_names=["b", "c"]), queued("mine")]
    report = explain("mine", queue, nodes, FLAVORS, running=running, now=NOW)
    assert report.summary[-1] == "Expected to start at 09:10 UTC when r1 ends."


def test_why_tells_the_likely_and_latest_start_as_predict_does() -> None:
    nodes, running = three_busy_nodes()
    queue = [queued("stuck", 2, node_names=["b", "c"]), queued("mine")]
    likely = Expected(ends={"r1": NOW + timedelta(minutes=4)})  # r1 usually ends sooner than its limit
    forecast = forecast_queued(["mine"], queue, nodes, FLAVORS, running=running, now=NOW, expected=likely)["mine"]
    report = explain("mine", queue, nodes, FLAVORS, running=running, now=NOW, forecast=forecast)
    clause = ("expected to start around 09:04 UTC, going by how long similar jobs ran; by 09:10 UTC when r1 ends "
              "if jobs run to their duration limits")
    assert forecast.prediction.reason == f"Waits behind 1 job; {clause}."
    assert report.summary[-1] == f"E{clause[1:]}."
