"""A job the scheduler archives (JobArchived) leaves the launcher whole: its launch, what the launcher keeps beside
it, the version of its launch aggregate and what the dispatcher kept of its requests. A launch still under way, or
processes given up on a node not yet known stopped, are seen through first. Other jobs are untouched.

The launcher runs on an in-memory event log with fake agents (tests/support/launcher.py).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from libs.contracts.agent import ProcessExited, ProcessStarted
from libs.contracts.events import (
    JobAdmitted,
    JobArchived,
    JobFailed,
    JobResuming,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    LaunchStopped,
    LaunchSucceeded,
    LostProcessesStopped,
    NodeProcessLost,
    Placement,
)
from services.launcher.service import Launcher
from services.launcher.state import LauncherState
from tests.support.eventlog import fake_runtime
from tests.support.launcher import GRACE, Site
from tests.support.platform import CLUSTER, JOB, OTHER, plain_spec


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Site:
    return Site(monkeypatch)


def kept(state: LauncherState) -> dict[str, Any]:
    """Everything the state keeps of jobs, field by field (the administrator's settings aside)."""
    held = {f.name: getattr(state, f.name) for f in fields(state) if f.compare and f.name != "lifecycle"}
    return {**held, "jobs": state.lifecycle.jobs}


def launch_versions(launcher: Launcher) -> set[str]:
    return {aggregate_id for (aggregate_type, aggregate_id) in launcher.versions if aggregate_type == "launch"}


def assert_holds_nothing(launcher: Launcher) -> None:
    assert kept(launcher.state) == kept(LauncherState())
    assert launch_versions(launcher) == set()
    assert launcher.dispatcher._calls == {}


async def start(site: Site, job_id: str, nodes: list[str]) -> None:
    """Submit and admit `job_id` on `nodes`, plan and start it, every rank reported started."""
    await site.scheduler(JobSubmitted(job_id=job_id, spec=plain_spec(len(nodes)), creator="alice"))
    placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(nodes)]
    await site.scheduler(JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-4", placement=placement))
    await site.dispatch()  # the nodes choose the rendezvous ports
    await site.dispatch()  # the attempt is planned and started
    for rank, node in enumerate(nodes):
        await site.report(ProcessStarted(job_id=job_id, attempt=1, rank=rank, node=node, pid=100 + rank))


async def succeed(site: Site, job_id: str, nodes: list[str]) -> None:
    for rank, node in enumerate(nodes):
        await site.report(ProcessExited(job_id=job_id, attempt=1, rank=rank, node=node, exit_code=0))
    await site.scheduler(JobSucceeded(job_id=job_id))
    await site.dispatch()


async def test_a_job_archived_after_its_whole_life_leaves_nothing_in_the_launcher(site: Site) -> None:
    await start(site, JOB, ["n1", "n2"])
    await succeed(site, JOB, ["n1", "n2"])
    assert site.recorded(LaunchSucceeded)
    assert JOB in site.launcher.state.launches and launch_versions(site.launcher) == {JOB}

    await site.scheduler(JobArchived(job_id=JOB, retention="1m"))
    assert_holds_nothing(site.launcher)
    await site.dispatch()  # a pass over every launch neither brings it back nor sends anything for it
    assert_holds_nothing(site.launcher)


async def test_a_restarted_launcher_holds_nothing_of_an_archived_job(site: Site) -> None:
    await start(site, JOB, ["n1"])
    await succeed(site, JOB, ["n1"])
    await site.scheduler(JobArchived(job_id=JOB, retention="1m"))

    restarted = Launcher(fake_runtime(site.log, "launcher"), CLUSTER)
    for envelope in site.log.envelopes:  # its own log first, then the scheduler's stream, as at a start
        if envelope.service == "launcher":
            restarted.apply(envelope)
    assert launch_versions(restarted) == {JOB}
    for envelope in site.log.envelopes:
        if envelope.service == "scheduler":
            restarted.state.apply_scheduler(envelope)

    assert_holds_nothing(restarted)


async def test_a_running_job_is_untouched_by_another_jobs_archival(site: Site) -> None:
    await start(site, JOB, ["n1"])
    await start(site, OTHER, ["n2"])
    await succeed(site, JOB, ["n1"])

    await site.scheduler(JobArchived(job_id=JOB, retention="1m"))
    state = site.launcher.state
    assert JOB not in state.launches and OTHER in state.launches
    assert launch_versions(site.launcher) == {OTHER}
    assert [launch.job_id for launch in state.active()] == [OTHER]

    # Its launch goes on at the version its log holds, and settles as before.
    await site.report(ProcessExited(job_id=OTHER, attempt=1, rank=0, node="n2", exit_code=0))
    assert [e.attempt for e in site.log.of("launcher", OTHER) if isinstance(e, LaunchSucceeded)] == [1]


async def test_a_launch_still_under_way_when_its_job_is_archived_is_stopped_first(site: Site) -> None:
    await start(site, JOB, ["n1", "n2"])
    # The launcher was away while the job ended and its retention passed: it hears of both at once.
    await site.scheduler(JobFailed(job_id=JOB, reason="node n1 was lost"))
    await site.scheduler(JobArchived(job_id=JOB, retention="1m"))
    state = site.launcher.state
    assert JOB in state.launches and JOB in state.archived  # its processes still run

    await site.dispatch()
    assert sorted((node, request.grace_seconds) for node, request, _ in site.agents.stops()) == [
        ("n1", GRACE), ("n2", GRACE)]
    for rank, node in enumerate(["n1", "n2"]):
        await site.report(ProcessExited(job_id=JOB, attempt=1, rank=rank, node=node, exit_code=143))
    await site.dispatch()
    assert [e.attempt for e in site.recorded(LaunchStopped)] == [1]  # seen through to its end, then let go
    await site.dispatch()
    assert_holds_nothing(site.launcher)


async def test_processes_given_up_keep_an_archived_job_until_their_node_stops_them(site: Site) -> None:
    await start(site, JOB, ["n1", "n2"])
    site.agents.unreachable.add("n2")
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n2 was lost", lost_nodes=["n2"]))
    await site.dispatch()
    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=0, node="n1", exit_code=143))
    await site.dispatch()
    assert [e.node for e in site.recorded(NodeProcessLost)] == ["n2"] and site.recorded(LaunchStopped)
    await site.scheduler(JobStopped(job_id=JOB, by="alice"))
    await site.scheduler(JobArchived(job_id=JOB, retention="1m"))
    await site.dispatch()
    assert site.launcher.state.fences == {(JOB, 1, "n2")}  # n2 is still to be made to stop them
    assert launch_versions(site.launcher) == {JOB}

    site.agents.unreachable.discard("n2")  # the node is back
    await site.dispatch()
    assert [e.node for e in site.recorded(LostProcessesStopped)] == ["n2"]
    assert_holds_nothing(site.launcher)
