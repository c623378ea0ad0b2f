"""The head's reservation and backfill: a job behind a blocked job starts early only when it cannot delay it;
jobs that fit nowhere never block anyone."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from libs.contracts.cluster import Flavor
from libs.contracts.jobspec import PRIORITY_RANK
from libs.placement import NodeCapacity, QueuedJob, RunningJob
from tests.support.placement import (
    CPU4,
    FLAVORS,
    GPU8,
    NOW,
    admitted,
    busy,
    cycle,
    elastic_spec,
    hosts,
    node,
    queued,
    run_on,
    spec,
)

CPU8 = Flavor(name="cpu-8", cpus=8, memory_mib=8192)
WITH_CPU8 = {**FLAVORS, "cpu-8": CPU8}


def at(seconds: int) -> datetime:
    return NOW + timedelta(seconds=seconds)


# --- the reservation --------------------------------------------------------------------------------------


def test_head_is_reserved_the_earliest_time_its_gang_fits() -> None:
    nodes = [node(n, cpus=4) for n in "abc"]
    running = [run_on("r1", ["a"], ends_in=600), run_on("r2", ["b"], ends_in=1200), run_on("r3", ["c"], ends_in=1800)]
    decision = cycle([queued("head", 2)], busy(nodes, running), running=running)
    assert decision.admissions == []
    reservation = decision.reservation
    assert reservation is not None
    assert (reservation.job_id, reservation.flavor, reservation.start) == ("head", "cpu-4", at(1200))
    assert sorted(reservation.nodes) == ["a", "b"]


def test_head_is_reserved_with_the_flavor_that_fits_first() -> None:
    nodes = [node("gpu", cpus=64, gpus=8), node("cpu", cpus=4)]
    running = [run_on("g", ["gpu"], flavor=GPU8, ends_in=3600), run_on("c", ["cpu"], ends_in=600)]
    decision = cycle([queued("head", 1, ["gpu-8", "cpu-4"])], busy(nodes, running), running=running)
    assert decision.reservation is not None
    assert (decision.reservation.flavor, decision.reservation.start) == ("cpu-4", at(600))


def test_flavor_order_breaks_a_tie_between_reservations() -> None:
    nodes = [node("gpu", cpus=64, gpus=8), node("cpu", cpus=4)]
    running = [run_on("g", ["gpu"], flavor=GPU8, ends_in=600), run_on("c", ["cpu"], ends_in=600)]
    decision = cycle([queued("head", 1, ["gpu-8", "cpu-4"])], busy(nodes, running), running=running)
    assert decision.reservation is not None and decision.reservation.flavor == "gpu-8"


def test_jobs_started_in_the_same_cycle_release_at_their_duration_limit() -> None:
    queue = [queued("first", duration=600), queued("head", flavors=["cpu-8"])]
    decision = cycle(queue, [node("a", cpus=8)], flavors=WITH_CPU8)
    assert admitted(decision) == ["first"]
    assert decision.reservation is not None and decision.reservation.start == at(600)


def test_a_job_past_its_duration_limit_is_expected_to_free_its_node_now() -> None:
    running = [run_on("late", ["a"], ends_in=-60)]
    decision = cycle([queued("head")], busy([node("a", cpus=4)], running), running=running)
    assert decision.reservation is not None and decision.reservation.start == NOW


def test_head_waiting_on_jobs_without_a_duration_limit_has_an_unknown_start() -> None:
    nodes = [node(n, cpus=4) for n in "ab"]
    running = [run_on("forever", ["a"]), run_on("timed", ["b"], ends_in=600)]
    decision = cycle([queued("head", 2)], busy(nodes, running), running=running)
    assert decision.reservation is not None
    assert decision.reservation.start is None
    assert sorted(decision.reservation.nodes) == ["a", "b"]


def test_elastic_head_is_reserved_at_its_full_size() -> None:
    nodes = [node(n, cpus=4, pools=["p"]) for n in "abc"]
    running = [run_on(f"r{n}", [n], ends_in=600 * (i + 1)) for i, n in enumerate("abc")]
    job = QueuedJob("elastic", elastic_spec(3, 1, pool="p"))
    decision = cycle([job], busy(nodes, running), running=running)
    assert decision.reservation is not None
    assert (decision.reservation.start, len(decision.reservation.nodes)) == (at(1800), 3)


# --- backfill ---------------------------------------------------------------------------------------------


def blocked_cluster() -> tuple[list[NodeCapacity], list[RunningJob]]:
    """a is busy for an hour, b and c are free; the head is pinned to a and b."""
    nodes = [node(n, cpus=4) for n in "abc"]
    running = [run_on("r", ["a"], ends_in=3600)]
    return busy(nodes, running), running


HEAD = queued("head", 2, node_names=["a", "b"])


def test_a_job_that_ends_before_the_reserved_start_is_backfilled() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("short", 2, duration=1800)], nodes, running=running)
    (admission,) = decision.admissions
    assert (admission.job_id, admission.backfilled) == ("short", True)
    assert sorted(hosts(admission)) == ["b", "c"]  # b is needed by the head, but only in an hour


def test_a_job_ending_exactly_at_the_reserved_start_is_backfilled() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("exact", 2, duration=3600)], nodes, running=running)
    assert admitted(decision) == ["exact"]


def test_a_job_that_would_delay_the_head_is_refused() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("long", 2, duration=7200), queued("unlimited", 2)], nodes, running=running)
    assert decision.admissions == []
    assert decision.reservation is not None and decision.reservation.start == at(3600)


def test_a_job_may_use_room_the_head_does_not_need_whatever_its_duration() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("unlimited")], nodes, running=running)
    (admission,) = decision.admissions
    assert (admission.job_id, hosts(admission), admission.backfilled) == ("unlimited", ["c"], True)


def test_backfilled_jobs_use_up_the_spare_room() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("one"), queued("two")], nodes, running=running)
    assert admitted(decision) == ["one"]


def test_with_an_unknown_start_only_room_the_head_does_not_need_is_used() -> None:
    nodes = [node(n, cpus=4) for n in "abc"]
    running = [run_on("forever", ["a"])]
    queue = [queued("head", 2, node_names=["a", "b"]), queued("short", duration=60), queued("other")]
    decision = cycle(queue, busy(nodes, running), running=running)
    assert decision.reservation is not None and decision.reservation.start is None
    (admission,) = decision.admissions
    assert (admission.job_id, hosts(admission)) == ("short", ["c"])


def test_only_the_first_blocked_job_gets_a_reservation() -> None:
    nodes, running = blocked_cluster()
    queue = [HEAD, queued("second", 3), queued("small")]
    decision = cycle(queue, nodes, running=running)
    assert decision.reservation is not None and decision.reservation.job_id == "head"
    assert admitted(decision) == ["small"]  # "second" does not hold anyone back


def test_a_job_that_fits_nowhere_neither_blocks_nor_is_reserved() -> None:
    queue = [queued("huge", nodes=9), queued("small")]  # two nodes hold 8 ranks at most
    decision = cycle(queue, [node("a"), node("b")])
    assert decision.unplaceable == ["huge"]
    assert admitted(decision) == ["small"]
    assert decision.reservation is None
    assert [a.backfilled for a in decision.admissions] == [False]


def test_jobs_asking_for_missing_pools_boards_or_nodes_are_unplaceable() -> None:
    queue = [queued("pool", pool="nowhere"), queued("pinned", node_names=["gone"]),
             queued("board", flavors=["gpu-8"]), queued("fine")]
    decision = cycle(queue, [node("a")])
    assert decision.unplaceable == ["pool", "pinned", "board"]
    assert admitted(decision) == ["fine"]


def test_an_unplaceable_job_behind_the_head_is_reported_too() -> None:
    nodes, running = blocked_cluster()
    decision = cycle([HEAD, queued("huge", 9)], nodes, running=running)
    assert decision.unplaceable == ["huge"]


# --- starvation -------------------------------------------------------------------------------------------


@dataclass
class Live:
    job: RunningJob
    actual_end: datetime


def test_a_big_urgent_job_is_not_starved_by_a_stream_of_small_jobs() -> None:
    """Small normal jobs keep arriving and finishing (some without a duration limit, most ending before
    their limit); the big urgent job still starts no later than its first reservation."""
    rng = random.Random(7)
    nodes = [node(n, cpus=4) for n in ("n1", "n2", "n3", "n4")]
    live = {f"r{i}": Live(run_on(f"r{i}", [n.info.name], ends_in=600 * (i + 1)), at(600 * (i + 1) - 100))
            for i, n in enumerate(nodes)}
    big = QueuedJob("big", spec(4, priority="urgent"), 3600)
    arrivals: list[tuple[datetime, QueuedJob]] = []
    for i in range(40):
        duration = rng.choice([None, 300, 600, 900, 1800])
        arrivals.append((at(60 * i + 30), QueuedJob(f"small-{i}", spec(1), duration)))
    queue = [big]
    first_reservation: datetime | None = None
    started: dict[str, datetime] = {}
    backfilled: list[str] = []
    clock = NOW
    for _ in range(500):
        for job_id in [j for j, run in live.items() if run.actual_end <= clock]:
            del live[job_id]
        while arrivals and arrivals[0][0] <= clock:
            queue.append(arrivals.pop(0)[1])
        queue.sort(key=lambda j: PRIORITY_RANK[j.spec.priority])  # stable: first come first served
        running = [run.job for run in live.values()]
        decision = cycle(queue, busy(nodes, running), running=running, now=clock)
        if decision.reservation is not None and decision.reservation.job_id == "big" and first_reservation is None:
            first_reservation = decision.reservation.start
        by_id = {j.job_id: j for j in queue}
        for admission in decision.admissions:
            job = by_id[admission.job_id]
            started[job.job_id] = clock
            if admission.backfilled:
                backfilled.append(job.job_id)
            limit = job.duration_seconds
            runtime = int(limit * rng.uniform(0.3, 1.0)) if limit else 7200
            live[job.job_id] = Live(
                RunningJob(job_id=job.job_id, spec=job.spec, flavor=CPU4, placement=admission.placement,
                           ends_at=clock + timedelta(seconds=limit) if limit else None),
                clock + timedelta(seconds=runtime))
        queue = [j for j in queue if j.job_id not in started]
        upcoming = [run.actual_end for run in live.values()] + [a[0] for a in arrivals[:1]]
        if not upcoming:
            break
        clock = min(upcoming)
    assert first_reservation is not None
    assert "big" in started and started["big"] <= first_reservation
    assert backfilled  # the stream did use the gaps before the big job's start


def test_backfilled_job_leaves_the_reserved_start_where_it_was() -> None:
    nodes, running = blocked_cluster()
    first = cycle([HEAD, queued("short", duration=1800), queued("spare")], nodes, running=running)
    assert admitted(first) == ["short", "spare"]
    # Next cycle: the backfilled jobs are running.
    durations = {"short": 1800, "spare": None}
    now_running = list(running)
    for admission in first.admissions:
        seconds = durations[admission.job_id]
        now_running.append(RunningJob(job_id=admission.job_id, spec=spec(), flavor=CPU4, placement=admission.placement,
                                      ends_at=at(seconds) if seconds is not None else None))
    total = [node(n, cpus=4) for n in "abc"]
    second = cycle([HEAD], busy(total, now_running), running=now_running)
    assert second.reservation == first.reservation
