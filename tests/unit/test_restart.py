"""Fault restart (SPEC J13, M5) as the scheduler decides it: a failed command starts again on the same
nodes once the rest of its attempt is down, up to the job's maximum; a node gone bad sends it back to
the queue instead."""

from __future__ import annotations

import pytest

from libs.contracts.events import (
    JobAdmitted,
    JobFailed,
    JobRequeued,
    JobRestarting,
    JobStopped,
    JobStopRequested,
    JobSucceeded,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeLost,
    NodeUnhealthy,
)
from libs.contracts.jobspec import FaultRestart
from services.scheduler.domain.names import job_change
from tests.support.platform import JOB, Platform, plain_spec


@pytest.fixture
def platform() -> Platform:
    return Platform()


def failure(attempt: int, code: int = 3) -> LaunchFailed:
    return LaunchFailed(job_id=JOB, attempt=attempt, reason=f"rank 1 on n2 exited with code {code}", exit_code=code)


async def started(platform: Platform, restarts: int) -> JobAdmitted:
    await platform.node("n1")
    await platform.node("n2")
    await platform.submit(JOB, plain_spec(nodes=2, fault_restart=FaultRestart(max_restarts=restarts)))
    await platform.cycle()
    admitted = platform.last(JOB)
    assert isinstance(admitted, JobAdmitted)  # no pre-check without checkpoint resume
    return admitted


async def test_a_failed_command_restarts_on_the_same_nodes_until_it_succeeds(platform: Platform) -> None:
    first = await started(platform, restarts=2)
    for attempt in (1, 2):
        await platform.launcher(failure(attempt))
        restarting = platform.last(JOB)
        assert isinstance(restarting, JobRestarting)
        assert (restarting.attempt, restarting.restarts, restarting.exit_code) == (attempt, attempt, 3)
        assert restarting.reason == "rank 1 on n2 exited with code 3"
        assert platform.view(JOB).status == "running"  # its nodes stay held while the rest stops
        await platform.launcher(LaunchStopped(job_id=JOB, attempt=attempt))
        admitted = platform.last(JOB)
        assert isinstance(admitted, JobAdmitted)
        assert (admitted.attempt, admitted.flavor, admitted.placement) == (attempt + 1, first.flavor, first.placement)
    await platform.launcher(LaunchSucceeded(job_id=JOB, attempt=3))
    assert isinstance(platform.last(JOB), JobSucceeded)
    view = platform.view(JOB)
    assert (view.status, view.attempt, view.restarts) == ("succeeded", 3, 2)


async def test_a_failure_at_the_maximum_fails_the_job_with_the_last_exit_code(platform: Platform) -> None:
    await started(platform, restarts=1)
    await platform.launcher(failure(1, code=3))
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    await platform.launcher(failure(2, code=9))
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed)
    assert failed.exit_code == 9
    assert failed.reason == "rank 1 on n2 exited with code 9; it was already restarted 1 time, its maximum"
    view = platform.view(JOB)
    assert (view.status, view.exit_code, view.restarts) == ("failed", 9, 1)


async def test_a_restart_waits_in_the_queue_when_a_node_became_unhealthy(platform: Platform) -> None:
    await started(platform, restarts=3)
    await platform.launcher(failure(1))
    await platform.node_event(NodeUnhealthy(node_name="n2", problems=["board:0 faulty"]))
    assert isinstance(platform.last(JOB), JobRestarting)  # a plain job is not moved by the fault itself
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    requeued = platform.last(JOB)
    assert isinstance(requeued, JobRequeued)
    assert requeued.reason == ("restart 1 after rank 1 on n2 exited with code 3; node n2 is unhealthy "
                               "(board:0 faulty), so it waits for other nodes")
    assert platform.view(JOB).status == "queued"
    await platform.node("n3")
    await platform.cycle()
    admitted = platform.last(JOB)
    assert isinstance(admitted, JobAdmitted)
    assert (admitted.attempt, sorted(p.node for p in admitted.placement)) == (2, ["n1", "n3"])
    assert platform.view(JOB).restarts == 1


async def test_a_lost_node_fails_a_restarting_job(platform: Platform) -> None:
    await started(platform, restarts=3)
    await platform.launcher(failure(1))
    await platform.node_event(NodeLost(node_name="n2", last_seen=platform.log.now, reason="no heartbeat for 12s"))
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed) and failed.reason == "node n2 was lost: no heartbeat for 12s"


async def test_a_job_without_fault_restart_fails_at_once(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, plain_spec())
    await platform.cycle()
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason="rank 0 on n1 exited with code 2",
                                         exit_code=2))
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed) and (failed.exit_code, failed.reason) == (2, "rank 0 on n1 exited with code 2")


async def test_a_failure_after_a_stop_request_is_not_restarted(platform: Platform) -> None:
    await started(platform, restarts=3)
    await platform.scheduler.record([job_change(JobStopRequested(job_id=JOB, by="alice"))])
    await platform.launcher(failure(1))
    assert not any(isinstance(e, JobRestarting) for e in platform.recorded(JOB))


async def test_a_stop_asked_while_the_job_restarts_ends_it_stopped(platform: Platform) -> None:
    await started(platform, restarts=3)
    await platform.launcher(failure(1))
    await platform.scheduler.record([job_change(JobStopRequested(job_id=JOB, by="alice"))])
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    assert isinstance(platform.last(JOB), JobStopped)


async def test_replaying_a_restarted_job_rebuilds_the_same_state(platform: Platform) -> None:
    await started(platform, restarts=2)
    await platform.launcher(failure(1))
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    await platform.launcher(failure(2))
    replayed = platform.replayed()
    assert replayed.view(replayed.jobs[JOB]) == platform.view(JOB)
    assert replayed.used() == platform.state.used()
