"""A job whose data could not be prepared on a node (SPEC J14): when the node is at fault (its disk), the job
of any kind waits for other nodes and never goes back there, without counting a resume; when no other node
could serve it, or the dataset itself is at fault, it fails saying why."""

from __future__ import annotations

import pytest

from libs.contracts.events import JobAdmitted, JobFailed, JobRequeued, JobResuming, LaunchFailed, LaunchStopped
from tests.support.platform import JOB, Platform, plain_spec


@pytest.fixture
def platform() -> Platform:
    return Platform()


def not_started(node: str, attempt: int = 1) -> LaunchFailed:
    reason = (f"rank 0 could not start: data preparation failed on node {node}: cannot write "
              f"/cache/partial/x/data/a.bin: No space left on device")
    return LaunchFailed(job_id=JOB, attempt=attempt, reason=reason, exit_code=127, fault_nodes=[node])


async def test_a_job_whose_node_could_not_prepare_its_data_is_tried_on_another_node(platform: Platform) -> None:
    await platform.node("n1")
    await platform.node("n2")
    await platform.submit(JOB, plain_spec(nodes=1))
    await platform.cycle()
    first = platform.last(JOB)
    assert isinstance(first, JobAdmitted)
    bad = first.placement[0].node

    await platform.launcher(not_started(bad))
    resuming = platform.last(JOB)
    assert isinstance(resuming, JobResuming) and resuming.before_start
    assert resuming.exclude_nodes == [bad] and "No space left on device" in resuming.reason
    await platform.launcher(LaunchStopped(job_id=JOB, attempt=1))
    requeued = platform.last(JOB)
    assert isinstance(requeued, JobRequeued) and requeued.resumes == 0  # it never ran: not a resume
    await platform.cycle()
    second = platform.last(JOB)
    assert isinstance(second, JobAdmitted) and second.attempt == 2
    assert {p.node for p in second.placement} == {"n1", "n2"} - {bad}


async def test_with_no_other_node_that_could_serve_it_the_job_fails_saying_so(platform: Platform) -> None:
    await platform.node("n1")
    await platform.submit(JOB, plain_spec(nodes=1))
    await platform.cycle()
    await platform.launcher(not_started("n1"))
    failed = platform.last(JOB)
    assert isinstance(failed, JobFailed)
    assert failed.reason.endswith("No space left on device; no other node could serve it")


async def test_a_dataset_at_fault_fails_the_job_at_once(platform: Platform) -> None:
    await platform.node("n1")
    await platform.node("n2")
    await platform.submit(JOB, plain_spec(nodes=1))
    await platform.cycle()
    reason = "rank 0 on n1 exited with code 127"  # no node at fault: datasets/x is not in shared storage
    await platform.launcher(LaunchFailed(job_id=JOB, attempt=1, reason=reason, exit_code=127))
    assert isinstance(platform.last(JOB), JobFailed)
