"""Checkpoint resume (SPEC J12, M1, M2, M4, M6) as the scheduler decides it: pre-checks, moves after a
fault, the resume count and its cap, nodes a slow job never goes back to.

A scheduler runs on an in-memory event log; the monitor's and launcher's events are fed to it the
way its followers would, and what it records is read back from the log.
"""

from __future__ import annotations

import pytest

from libs.contracts.events import (
    JobAdmitted,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobRequeued,
    JobRescaling,
    JobResuming,
    JobStopped,
    JobStopRequested,
    LaunchFailed,
    LaunchStopped,
    NodeHealthy,
    NodeUnhealthy,
    PerformanceDegraded,
    PrecheckCompleted,
)
from libs.contracts.jobspec import CheckpointResume, Elastic, PerformanceDetection
from services.autoscaler.state import AutoscalerState
from services.scheduler.domain.names import job_change
from services.scheduler.domain.views import node_views
from tests.support.platform import JOB, OTHER, Platform, check, job_spec, plain_spec


@pytest.fixture
def platform() -> Platform:
    return Platform()


# --- M1: pre-checks ----------------------------------------------------------------------------------------


async def test_a_checkpoint_job_is_prechecked_before_it_starts_and_holds_its_nodes(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.submit(OTHER, plain_spec())
    await platform.cycle()
    precheck = platform.last(JOB)
    assert isinstance(precheck, JobPrechecking)
    assert (precheck.attempt, precheck.flavor, [p.node for p in precheck.placement]) == (1, "cpu-4", ["n1"])
    view = platform.view(JOB)
    assert (view.status, view.queue_position) == ("queued", None)
    # The node is held: the other job waits although the pre-checked one has not started.
    assert platform.view(OTHER).status == "queued"
    assert [v.jobs for v in node_views(platform.state)] == [[JOB]]


async def test_a_passed_precheck_admits_the_job_where_it_was_checked(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    admitted = await platform.start(JOB)
    assert (admitted.attempt, admitted.flavor, [p.node for p in admitted.placement]) == (1, "cpu-4", ["n1"])
    assert not admitted.backfilled
    assert platform.view(JOB).status == "running"


async def test_a_failed_precheck_puts_the_job_back_and_it_tries_other_nodes(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.cycle()
    await platform.monitor(PrecheckCompleted(job_id=JOB, attempt=1, passed=False,
                                             nodes=[check("n1", "0")]))
    failed = platform.last(JOB)
    assert isinstance(failed, JobPrecheckFailed)
    assert failed.nodes == ["n1"]
    assert failed.reason == "the pre-check failed on n1: board:0 faulty (xid 79)"
    view = platform.view(JOB)
    assert (view.status, view.queue_position, view.reason) == ("queued", 1, failed.reason)
    await platform.node("n2")
    await platform.cycle()
    retry = platform.last(JOB)
    assert isinstance(retry, JobPrechecking)
    assert (retry.attempt, [p.node for p in retry.placement]) == (1, ["n2"])


async def test_a_job_in_precheck_waits_for_the_verdict_when_its_node_goes_down(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.cycle()
    await platform.lose("n1")
    assert isinstance(platform.last(JOB), JobPrechecking)
    # Even a passing verdict does not start it on a node that is gone.
    await platform.monitor(PrecheckCompleted(job_id=JOB, attempt=1, passed=True, nodes=[check("n1")]))
    failed = platform.last(JOB)
    assert isinstance(failed, JobPrecheckFailed)
    assert failed.reason == "since the pre-check passed, node n1 is lost"


async def test_a_verdict_for_another_attempt_is_ignored(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.cycle()
    await platform.monitor(PrecheckCompleted(job_id=JOB, attempt=7, passed=True, nodes=[check("n1")]))
    assert isinstance(platform.last(JOB), JobPrechecking)


# --- M2: faults on a running job's node --------------------------------------------------------------------


async def test_a_lost_node_moves_a_checkpoint_job_and_fails_a_plain_one(platform: Platform) -> None:
    await platform.node("n1", cpus=8)
    await platform.submit(JOB, job_spec())
    await platform.submit(OTHER, plain_spec())
    await platform.start(JOB)
    assert platform.view(OTHER).status == "running"
    await platform.lose("n1")
    resuming = platform.last(JOB)
    assert isinstance(resuming, JobResuming)
    assert resuming.lost_nodes == ["n1"]
    assert resuming.reason == "node n1 was lost: no heartbeat for 12s"
    assert platform.view(JOB).status == "running"  # until its attempt is down
    failed = platform.last(OTHER)
    assert isinstance(failed, JobFailed) and failed.reason == "node n1 was lost: no heartbeat for 12s"


async def test_an_unhealthy_node_moves_only_checkpoint_jobs(platform: Platform) -> None:
    await platform.node("n1", cpus=8)
    await platform.submit(JOB, job_spec())
    await platform.submit(OTHER, plain_spec())
    await platform.start(JOB)
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["board:0 faulty (xid 79)"]))
    resuming = platform.last(JOB)
    assert isinstance(resuming, JobResuming)
    assert (resuming.reason, resuming.lost_nodes) == ("node n1 is unhealthy: board:0 faulty (xid 79)", [])
    assert resuming.fault_nodes == ["n1"]  # the job-resuming alert names the node
    assert platform.view(OTHER).status == "running"
    assert [(v.status, v.problems) for v in node_views(platform.state)] == [("unhealthy", ["board:0 faulty (xid 79)"])]
    # The problems change: the job is already being moved, nothing more is recorded.
    count = len(platform.recorded(JOB))
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["board:0 faulty", "nic:eth0 faulty"]))
    assert len(platform.recorded(JOB)) == count


async def test_an_unhealthy_node_takes_no_new_job_until_it_is_healthy(platform: Platform) -> None:
    await platform.node("n1")
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["runtime:storage faulty"]))
    await platform.submit(OTHER, plain_spec())
    await platform.cycle()
    assert platform.view(OTHER).status == "queued"
    await platform.node_event(NodeHealthy(node_name="n1"))
    await platform.cycle()
    assert platform.view(OTHER).status == "running"


async def test_a_moved_job_waits_in_the_queue_at_its_old_place_then_resumes(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.start(JOB)
    await platform.submit(OTHER, job_spec())  # submitted later: it queues behind
    await platform.lose("n1")
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    requeued = platform.last(JOB)
    assert isinstance(requeued, JobRequeued)
    assert (requeued.resumes, requeued.reason) == (1, "node n1 was lost: no heartbeat for 12s")
    view = platform.view(JOB)
    assert (view.status, view.queue_position, view.placement, view.resumes) == ("queued", 1, [], 1)
    assert view.max_resumes == 3
    await platform.node("n2")
    admitted = await platform.start(JOB)
    assert (admitted.attempt, [p.node for p in admitted.placement]) == (2, ["n2"])
    assert platform.view(OTHER).status == "queued"


async def test_a_stop_asked_while_the_job_is_moved_ends_it_stopped(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.start(JOB)
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["nic:eth0 faulty"]))
    await platform.scheduler.record([job_change(JobStopRequested(job_id=JOB, by="alice"))])
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    assert isinstance(platform.last(JOB), JobStopped)


async def test_a_rank_failing_while_the_job_is_moved_does_not_fail_it(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.start(JOB)
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["nic:eth0 faulty"]))
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason="rank 0 on n1 exited with code 1",
                                         exit_code=1))
    assert isinstance(platform.last(JOB), JobResuming)
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    assert isinstance(platform.last(JOB), JobRequeued)


# --- M4: resumes are counted against the maximum -------------------------------------------------------------


async def move(platform: Platform, node: str) -> None:
    """Start the job on `node`, then make the node unhealthy and report its attempt stopped."""
    await platform.node(node)
    admitted = await platform.start(JOB)
    assert [p.node for p in admitted.placement] == [node]
    await platform.node_event(NodeUnhealthy(node_name=node, problems=["board:0 faulty"]))
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=admitted.attempt))


async def test_a_job_past_its_maximum_resumes_fails_saying_so(platform: Platform) -> None:
    await platform.submit(JOB, job_spec(checkpoint_resume=CheckpointResume(max_resumes=2)))
    await move(platform, "n1")
    await move(platform, "n2")
    assert platform.view(JOB).resumes == 2
    await move(platform, "n3")
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed)
    assert failed.reason == "node n3 is unhealthy: board:0 faulty; it already resumed 2 times, its maximum"
    assert platform.view(JOB).status == "failed"


async def test_the_administrator_cap_lowers_the_maximum(platform: Platform) -> None:
    await platform.settings(max_resumes_cap=1)
    await platform.submit(JOB, job_spec(checkpoint_resume=CheckpointResume(max_resumes=5)))
    assert platform.view(JOB).max_resumes == 1
    await move(platform, "n1")
    await move(platform, "n2")
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed)
    assert failed.reason.endswith("; it already resumed 1 time, its maximum")


async def test_a_job_that_may_not_resume_fails_after_its_first_fault(platform: Platform) -> None:
    await platform.submit(JOB, job_spec(checkpoint_resume=CheckpointResume(max_resumes=0)))
    await move(platform, "n1")
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed) and failed.reason.endswith("; it may not resume")


# --- M6: a slow job is moved and never goes back ------------------------------------------------------------


def slow(node: str, action: str = "reschedule", attempt: int = 1) -> PerformanceDegraded:
    return PerformanceDegraded(job_id=JOB, attempt=attempt, node=node, rank=0, ratio=0.91, threshold=0.8,
                               direction="above", window=10, action=action)


async def test_a_slow_job_is_rescheduled_away_from_its_node_for_good(platform: Platform) -> None:
    resume = CheckpointResume(performance=PerformanceDetection(threshold=0.8, action="reschedule"))
    await platform.node("n1", cpus=8)
    await platform.submit(JOB, job_spec(checkpoint_resume=resume))
    await platform.start(JOB)
    await platform.monitor(slow("n1", action="alert"))
    assert isinstance(platform.last(JOB), JobAdmitted)  # alert only
    await platform.monitor(slow("n1"))
    resuming = platform.last(JOB)
    assert isinstance(resuming, JobResuming)
    assert resuming.exclude_nodes == ["n1"]
    assert resuming.reason == ("it is slow on node n1: hardware time / e2e time was 0.91 over 10 iterations, "
                               "above its threshold of 0.8")
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    assert platform.view(JOB).excluded_nodes == ["n1"]
    # n1 is free and healthy, but the job never goes back there.
    await platform.cycle()
    assert platform.view(JOB).status == "queued" and isinstance(platform.last(JOB), JobRequeued)
    await platform.node("n2")
    admitted = await platform.start(JOB)
    assert [p.node for p in admitted.placement] == ["n2"]


async def test_an_elastic_job_comes_back_smaller_when_its_full_size_does_not_fit(platform: Platform) -> None:
    elastic = CheckpointResume(elastic=Elastic(min_nodes=2, allow_scale_up=False))
    await platform.node("n1")
    await platform.node("n2")
    await platform.node("n3")
    await platform.submit(JOB, job_spec(nodes=3, checkpoint_resume=elastic))
    await platform.start(JOB)
    assert sorted(platform.nodes_of(JOB)) == ["n1", "n2", "n3"]
    await platform.lose("n3")
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    admitted = await platform.start(JOB)
    assert sorted(p.node for p in admitted.placement) == ["n1", "n2"]


async def test_a_grown_checkpoint_job_is_prechecked_on_its_new_placement(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec(nodes=2, checkpoint_resume=CheckpointResume(elastic=Elastic(min_nodes=1))))
    await platform.start(JOB)
    assert platform.nodes_of(JOB) == ["n1"]  # short of nodes: started on its minimum
    await platform.node("n2")
    await platform.cycle()
    assert isinstance(platform.last(JOB), JobRescaling)
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    requeued, precheck = platform.recorded(JOB)[-2:]
    assert isinstance(requeued, JobRequeued) and requeued.resumes == 0  # a growth is no resume
    assert isinstance(precheck, JobPrechecking)
    assert (precheck.attempt, sorted(p.node for p in precheck.placement)) == (2, ["n1", "n2"])
    # Its new nodes are held while they are checked: no other job takes them.
    await platform.submit(OTHER, plain_spec())
    await platform.cycle()
    assert platform.view(OTHER).status == "queued"
    await platform.monitor(PrecheckCompleted(job_id=JOB, attempt=2, passed=True,
                                             nodes=[check("n1"), check("n2")]))
    admitted = platform.last(JOB)
    assert isinstance(admitted, JobAdmitted) and sorted(p.node for p in admitted.placement) == ["n1", "n2"]


# --- the log is the state ---------------------------------------------------------------------------------


async def test_replaying_the_log_rebuilds_the_same_state(platform: Platform) -> None:
    await platform.settings(max_resumes_cap=4)
    await platform.node("n1", cpus=8)
    await platform.submit(JOB, job_spec())
    await platform.submit(OTHER, plain_spec())
    await platform.start(JOB)
    await platform.monitor(slow("n1"))
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    await platform.node_event(NodeUnhealthy(node_name="n1", problems=["board:0 faulty"]))
    await platform.node("n2")
    await platform.cycle()
    replayed = platform.replayed()
    assert [replayed.view(j) for j in replayed.jobs.values()] == [platform.view(JOB), platform.view(OTHER)]
    assert node_views(replayed) == node_views(platform.state)
    assert [j.job_id for j in replayed.queue()] == [j.job_id for j in platform.state.queue()]
    assert replayed.used() == platform.state.used()


async def test_the_autoscaler_sees_a_moved_job_as_demand_again(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    demand = AutoscalerState()
    await platform.cycle()  # pre-checking: its nodes are held, it asks for none
    for envelope in platform.log.envelopes:
        demand.apply_scheduler(envelope)
    assert (demand.queued, demand.running) == ({}, set())
    seen = len(platform.log.envelopes)
    await platform.monitor(PrecheckCompleted(job_id=JOB, attempt=1, passed=True, nodes=[check("n1")]))
    await platform.lose("n1")
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    for envelope in platform.log.envelopes[seen:]:
        demand.apply_scheduler(envelope)
    assert (demand.queued_by_flavor(), demand.running) == ({"cpu-4": 1}, set())


# --- a peer's failure explained by a node fault -------------------------------------------------------------


async def test_a_failure_followed_by_a_lost_node_resumes_the_job_instead_of_failing_it(platform: Platform) -> None:
    # A dead node's peers fail in their collectives before its heartbeats are even missed.
    await platform.node("n1")
    await platform.node("n2")
    await platform.node("n3")
    await platform.submit(JOB, job_spec(nodes=2))
    await platform.start(JOB)
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason="rank 0 on n1 exited with code 1",
                                         exit_code=1))
    await platform.cycle()
    assert platform.view(JOB).status == "running"  # not yet: the failure waits for an explanation
    lost = platform.nodes_of(JOB)[1]
    await platform.lose(lost)
    resuming = platform.last(JOB)
    assert isinstance(resuming, JobResuming)
    assert resuming.lost_nodes == [lost]
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    assert isinstance(platform.last(JOB), JobRequeued)
    assert platform.view(JOB).resumes == 1


async def test_a_failure_no_fault_explains_fails_the_job_after_the_settle_time(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, job_spec())
    await platform.start(JOB)
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason="rank 0 on n1 exited with code 2",
                                         exit_code=2))
    await platform.cycle()
    assert platform.view(JOB).status == "running"
    platform.log.now += platform.scheduler.settle
    await platform.cycle()
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed)
    assert (failed.exit_code, failed.reason) == (2, "rank 0 on n1 exited with code 2")
    assert platform.replayed().jobs[JOB].status == "failed"


async def test_a_failure_on_a_node_already_known_faulty_resumes_at_once(platform: Platform) -> None:
    await platform.node("n1")
    await platform.node("n2")
    await platform.submit(JOB, job_spec())
    await platform.start(JOB)
    node = platform.nodes_of(JOB)[0]
    await platform.node_event(NodeUnhealthy(node_name=node, problems=["board:0 faulty"]))
    # The fault already moved it; the failure that follows changes nothing.
    assert isinstance(platform.last(JOB), JobResuming)
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason="rank 0 exited with code 1", exit_code=1))
    assert isinstance(platform.last(JOB), JobResuming)
