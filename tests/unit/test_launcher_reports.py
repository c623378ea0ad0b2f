"""What the launcher records of the agents' process reports: a start and an exit once each, and the outcome
with the last exit; a start reported with its exit (a command that ended at once) is recorded with it.

The launcher runs on an in-memory event log; node agents are a fake that answers every call
(tests/support/launcher.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from libs.contracts import subjects
from libs.contracts.agent import ProcessExited, ProcessStarted
from libs.contracts.events import (
    JobAdmitted,
    JobSubmitted,
    LaunchSucceeded,
    NodeProcessExited,
    NodeProcessStarted,
    Placement,
)
from services.launcher.rules import report_refusal
from tests.support.launcher import Site
from tests.support.platform import JOB, job_spec, plain_spec

STARTED_AT = datetime(2024, 5, 1, 8, 59, 58, tzinfo=UTC)
EXITED_AT = datetime(2024, 5, 1, 8, 59, 59, tzinfo=UTC)


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Site:
    return Site(monkeypatch)


async def admitted(site: Site, nodes: list[str]) -> None:
    """A job of `nodes`, admitted and started on them (no rank reported yet)."""
    await site.scheduler(JobSubmitted(job_id=JOB, spec=plain_spec(len(nodes)), creator="alice"))
    placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(nodes)]
    await site.scheduler(JobAdmitted(job_id=JOB, attempt=1, flavor="cpu-4", placement=placement))
    await site.dispatch()
    await site.dispatch()


def start(rank: int, node: str) -> ProcessStarted:
    return ProcessStarted(job_id=JOB, attempt=1, rank=rank, node=node, pid=100 + rank, started_at=STARTED_AT)


def kinds(site: Site) -> list[type]:
    return [type(e) for e in site.log.of("launcher", JOB) if isinstance(e, NodeProcessStarted | NodeProcessExited
                                                                          | LaunchSucceeded)]


async def test_a_start_reported_with_its_exit_is_recorded_before_it_with_the_outcome(site: Site) -> None:
    await admitted(site, ["n1"])
    appends = len(site.log.envelopes)

    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=0, node="n1", exit_code=0, exited_at=EXITED_AT,
                                    started=start(0, "n1")))

    assert kinds(site) == [NodeProcessStarted, NodeProcessExited, LaunchSucceeded]
    [started] = site.recorded(NodeProcessStarted)
    assert (started.pid, started.node, started.started_at) == (100, "n1", STARTED_AT)
    assert len(site.log.envelopes) == appends + 3


async def test_a_start_reported_before_is_not_recorded_again_with_the_exit(site: Site) -> None:
    await admitted(site, ["n1", "n2"])
    await site.report(start(0, "n1"))
    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=0, node="n1", exit_code=0, started=start(0, "n1")))
    assert kinds(site) == [NodeProcessStarted, NodeProcessExited]  # rank 1 still to end

    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=1, node="n2", exit_code=0, started=start(1, "n2")))
    await site.report(start(1, "n2"))  # a late repeat of the start changes nothing

    assert kinds(site) == [NodeProcessStarted, NodeProcessExited, NodeProcessStarted, NodeProcessExited,
                           LaunchSucceeded]
    assert [e.rank for e in site.recorded(NodeProcessStarted)] == [0, 1]


async def test_a_parameter_server_reported_started_after_its_workers_ended_is_stopped(site: Site) -> None:
    # Both workers end at once, each reporting its start with its exit: the launch succeeds before the
    # parameter server's start (reported once it ran a while) arrives.
    spec = job_spec(2, mode="tensorflow", parameter_servers=1, checkpoint_resume=None)
    await site.scheduler(JobSubmitted(job_id=JOB, spec=spec, creator="alice"))
    placement = [Placement(rank=0, node="n1", address="addr-n1", slots=1),
                 Placement(rank=1, node="n2", address="addr-n2", slots=1),
                 Placement(rank=2, node="n1", address="addr-n1", slots=1, role="ps")]
    await site.scheduler(JobAdmitted(job_id=JOB, attempt=1, flavor="cpu-4", placement=placement))
    await site.dispatch()
    await site.dispatch()
    for rank, node in ((0, "n1"), (1, "n2")):
        await site.report(ProcessExited(job_id=JOB, attempt=1, rank=rank, node=node, exit_code=0,
                                        started=start(rank, node)))
    assert site.recorded(LaunchSucceeded)
    await site.dispatch()
    assert not site.agents.stops()  # nothing known to run

    await site.report(start(2, "n1"))
    await site.dispatch()

    assert "n1" in {node for node, request, _ in site.agents.stops() if request.task is None}


async def test_a_report_is_taken_only_from_the_node_that_runs_the_process_it_names(site: Site) -> None:
    await admitted(site, ["n1", "n2"])
    state = site.launcher.state
    own = ProcessExited(job_id=JOB, attempt=1, rank=0, node="n1", exit_code=1)
    assert report_refusal(state, own, subjects.agent_report("n1")) is None
    # Published by n2 but naming n1: a forgery of another node's report.
    assert report_refusal(state, own, subjects.agent_report("n2")) == (
        f"published by node n2 on {subjects.agent_report('n2')} but it names node n1")
    # n2 naming itself, about the rank the plan put on n1.
    other = ProcessExited(job_id=JOB, attempt=1, rank=0, node="n2", exit_code=1)
    assert report_refusal(state, other, subjects.agent_report("n2")) == (
        f"node n2 reported task 0 rank 0 of {JOB} attempt 1, which runs on n1")
    assert report_refusal(state, start(0, "n2"), subjects.agent_report("n2")) is not None
    # A rank the plan does not have, and a report of an attempt not running (nothing is recorded of it).
    assert report_refusal(state, start(5, "n2"), subjects.agent_report("n2")) == (
        f"{JOB} attempt 1 has no task 0 rank 5")
    stale = ProcessExited(job_id=JOB, attempt=7, rank=0, node="n2", exit_code=1)
    assert report_refusal(state, stale, subjects.agent_report("n2")) is None
