"""What if (`trainyard simulate`): recorded history replayed in virtual time. With no change, every job that waited
in the window starts when it really did; a change moves the jobs it should, and a change that cannot be made is
refused with the reason."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.cluster import Flavor, NodeInfo
from libs.contracts.events import JobStopped, JobSubmitted, NodeRegistered
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.planning import SimulateHistory, SimulationReport
from services.scheduler.history.whatif import Start, WhatIfError, recorded, what_if
from tests.support.placement import NOW, info
from tests.support.strategies import SETTINGS
from tests.support.virtual_scheduler import VirtualScheduler

FLAVORS = {f"c{cpus}": Flavor(name=f"c{cpus}", cpus=cpus, memory_mib=1024) for cpus in (1, 2, 4)}


@dataclass
class History:
    nodes: list[NodeInfo]
    jobs: list[tuple[int, JobSpec]]  # minutes after NOW it was submitted, its spec
    window_from: int  # minutes after NOW
    stopped: list[int]  # indices of jobs stopped (while queued, if they were) a minute after their submission


@st.composite
def histories(draw: st.DrawFn) -> History:
    nodes = [info(f"n{index}", cpus=4, memory_mib=8192) for index in range(draw(st.integers(1, 3)))]
    jobs = [(draw(st.integers(0, 90)),
             JobSpec(name=f"j{index}", mode="pytorch", nodes=draw(st.sampled_from([1, 1, 2])),
                     flavors=draw(st.lists(st.sampled_from(sorted(FLAVORS)), min_size=1, max_size=2, unique=True)),
                     priority=draw(st.sampled_from(["urgent", "normal", "normal"])),
                     duration=draw(st.sampled_from(["5m", "10m", "15m", "30m", "1h"]))))
            for index in range(draw(st.integers(1, 16)))]
    return History(nodes, jobs, draw(st.integers(0, 90)), [])


@dataclass
class Played:
    start: Start
    end: datetime
    scheduler: VirtualScheduler
    started_in_window: dict[str, datetime]


def play(history: History) -> Played:
    """The scheduler's fold and cycles over the history, every job ending at its limit; the state at the window's
    start is taken as `trainyard simulate` rebuilds it."""
    scheduler = VirtualScheduler(FLAVORS)
    for node_info in history.nodes:
        scheduler.record(NodeRegistered(node=node_info), NOW, service="monitor", aggregate=node_info.name)
    submissions = sorted((NOW + timedelta(minutes=minutes), index, spec)
                         for index, (minutes, spec) in enumerate(history.jobs))
    stops = sorted((NOW + timedelta(minutes=history.jobs[index][0] + 1), f"job-{index:012x}")
                   for index in history.stopped)
    begin = NOW + timedelta(minutes=history.window_from)
    start: Start | None = None
    before: set[str] = set()
    now = NOW
    while True:
        while submissions and submissions[0][0] <= now:
            at, index, spec = submissions.pop(0)
            scheduler.record(JobSubmitted(job_id=f"job-{index:012x}", spec=spec, creator="alice"), at,
                             aggregate=f"job-{index:012x}")
        while stops and stops[0][0] <= now:
            at, job_id = stops.pop(0)
            if scheduler.state.jobs[job_id].status == "queued":
                scheduler.record(JobStopped(job_id=job_id, by="alice"), at, aggregate=job_id)
        scheduler.cycles(now)
        following = [t for t in (scheduler.next_end(), submissions[0][0] if submissions else None,
                                 stops[0][0] if stops else None) if t is not None]
        upcoming = min(following) if following else None
        if start is None and (upcoming is None or upcoming > begin):  # the state at `begin`, as recorded by then
            start = Start.of(scheduler.state, begin)
            before = set(scheduler.started)
        if upcoming is None:
            break
        now = upcoming
        scheduler.end_jobs(now)
    assert start is not None
    end = max(now, begin) + timedelta(minutes=1)
    return Played(start, end, scheduler, {j: at for j, at in scheduler.started.items() if j not in before})


def replay(played: Played, **changes: object) -> SimulationReport:
    state = played.scheduler.state
    request = SimulateHistory(start=played.start.at, end=played.end, **changes)  # type: ignore[arg-type]
    history = recorded(state.jobs, state.flavors, played.start, played.end)
    return what_if(request, played.start, played.end, history, [n.info for n in state.nodes.values()])


@settings(SETTINGS, max_examples=200)
@given(histories())
def test_replayed_with_no_change_every_job_that_waited_starts_when_it_really_did(history: History) -> None:
    played = play(history)
    report = replay(played)
    assert report.compared == len(played.started_in_window)
    assert report.same_start == report.compared and report.moved == []
    assert report.start_difference_p95 in (None, 0.0)
    for waits in report.waits:
        assert (waits.simulated_p50, waits.simulated_p95) == (waits.real_p50, waits.real_p95)
    assert [(u.real, u.simulated) for u in report.utilization] == [(u.real, u.real) for u in report.utilization]


@settings(SETTINGS, max_examples=100)
@given(histories())
def test_more_nodes_never_start_a_job_later_than_it_really_started_when_all_are_alike(history: History) -> None:
    # Single-node jobs of one flavor and one priority: first come, first served on more slots lets each start as
    # soon or sooner. Not so with priorities: with more nodes, normal jobs that started sooner may fill every slot
    # when an urgent one comes, which on fewer nodes found a slot freed by a job that ended (nothing is preempted).
    history.jobs = [(minutes, JobSpec(name=spec.name, mode="single-node", flavors=["c2"], priority="normal",
                                      duration=spec.duration)) for minutes, spec in history.jobs]
    played = play(history)
    report = replay(played, add_nodes={"c2": 2})
    assert report.nodes_simulated == report.nodes_real + 2
    for moved in report.moved:
        assert moved.simulated_start is not None
        assert moved.real_start is None or moved.simulated_start < moved.real_start


def test_a_second_node_lets_the_job_behind_start_at_once() -> None:
    one_node = History([info("n0", cpus=4, memory_mib=8192)], [
        (0, JobSpec(name="first", mode="single-node", flavors=["c4"], duration="1h")),
        (10, JobSpec(name="second", mode="single-node", flavors=["c4"], duration="1h"))], 0, [])
    played = play(one_node)
    same = replay(played)
    # The first was running at the window's start; the second waited 50 minutes for it.
    assert [(w.priority, w.jobs, w.real_p50, w.simulated_p50) for w in same.waits] == [("normal", 1, 3000.0, 3000.0)]
    assert same.makespan_real_seconds == same.makespan_simulated_seconds == 2 * 3600
    more = replay(played, add_nodes={"c4": 1})
    assert [(m.job_id, m.real_start, m.simulated_start) for m in more.moved] == [
        ("job-000000000001", NOW + timedelta(hours=1), NOW + timedelta(minutes=10))]
    assert more.makespan_simulated_seconds == (70 * 60)
    # With a second node, not at all.
    wait = more.waits[0]
    assert (wait.real_p95, wait.simulated_p95) == (50 * 60, 0.0)
    # The node was busy for two hours of the window's 121 minutes; two nodes for an hour each of twice that.
    assert [(u.flavor, u.real, u.simulated) for u in same.utilization] == [("c4", 0.9917, 0.9917)]
    assert more.utilization[0].simulated == round(120 / 242, 4)


def test_jobs_stopped_before_they_started_are_left_out_and_said_so() -> None:
    history = History([info("n0", cpus=4, memory_mib=8192)], [
        (0, JobSpec(name="first", mode="single-node", flavors=["c4"], duration="1h")),
        (5, JobSpec(name="gave-up", mode="single-node", flavors=["c4"], duration="1h"))], 0, [1])
    report = replay(play(history))
    assert report.jobs == 1
    assert any("1 jobs stopped or deleted before they started are left out" in note for note in report.notes)


@pytest.mark.parametrize(("changes", "said"), [
    ({"add_nodes": {"gpu-8": 1}}, "unknown flavor 'gpu-8'"),
    ({"remove_nodes": {"c4": 2}}, "only 1 nodes of c4 were idle"),
])
def test_a_change_that_cannot_be_made_is_refused_with_the_reason(changes: dict[str, object], said: str) -> None:
    played = play(History([info("n0", cpus=4, memory_mib=8192)], [], 0, []))
    with pytest.raises(WhatIfError, match=said):
        replay(played, **changes)
