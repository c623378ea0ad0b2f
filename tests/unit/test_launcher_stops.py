"""How the launcher stops an attempt (SPEC J12, J13, M3): the checkpoint signal and the job's graceful
shutdown time, processes on a lost node given up at once, and a failed attempt reported stopped so
that its restart starts on free nodes.

The launcher runs on an in-memory event log; node agents are a fake that answers every call and
remembers it (tests/support/launcher.py).
"""

from __future__ import annotations

import asyncio

import jwt
import pytest

from libs.contracts.agent import ProcessExited
from libs.contracts.events import (
    JobAdmitted,
    JobFailed,
    JobRequeued,
    JobRestarting,
    JobResuming,
    JobStopRequested,
    JobSubmitted,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LostProcessesStopped,
    NodeProcessLost,
    Placement,
    SettingsChanged,
)
from libs.contracts.jobspec import CheckpointResume, DebugTerminal, FaultRestart
from libs.contracts.scheduling import AdminSettings
from services.launcher.service import Launcher
from tests.support.eventlog import fake_runtime
from tests.support.launcher import GRACE, Site, launches
from tests.support.platform import CLUSTER, JOB, OTHER, job_spec, plain_spec


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Site:
    return Site(monkeypatch)


# --- J12/M3: the checkpoint signal and the graceful shutdown time ---------------------------------------------


async def test_a_checkpoint_job_is_signalled_and_given_its_grace(site: Site) -> None:
    await site.scheduler(SettingsChanged(settings=AdminSettings(max_graceful_shutdown_seconds=600), by="root"))
    await site.run(job_spec(2, checkpoint_resume=CheckpointResume(graceful_shutdown_seconds=120)), ["n1", "n2"])
    await site.scheduler(JobStopRequested(job_id=JOB, by="alice"))
    await site.dispatch()
    stops = sorted(site.agents.stops(), key=lambda s: s[0])
    assert [(node, r.checkpoint_signal, r.grace_seconds, r.task) for node, r, _ in stops] == [
        ("n1", "SIGUSR1", 120.0, None), ("n2", "SIGUSR1", 120.0, None)]
    # The agent answers once the processes are gone: the launcher waits longer than the grace.
    assert all(timeout > 120.0 for _, _, timeout in stops)


async def test_the_administrator_caps_the_graceful_shutdown_time(site: Site) -> None:
    await site.scheduler(SettingsChanged(settings=AdminSettings(max_graceful_shutdown_seconds=30), by="root"))
    await site.run(job_spec(checkpoint_resume=CheckpointResume(graceful_shutdown_seconds=120)), ["n1"])
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n1 is unhealthy: board:0 faulty"))
    await site.dispatch()
    [(_, request, _)] = site.agents.stops()
    assert (request.checkpoint_signal, request.grace_seconds) == ("SIGUSR1", 30.0)


async def test_other_jobs_are_stopped_with_the_platform_grace(site: Site) -> None:
    await site.run(plain_spec(), ["n1"])
    await site.scheduler(JobStopRequested(job_id=JOB, by="alice"))
    await site.dispatch()
    [(_, request, _)] = site.agents.stops()
    assert (request.checkpoint_signal, request.grace_seconds) == (None, GRACE)


async def test_the_signal_is_sent_once_while_the_job_saves(site: Site) -> None:
    await site.run(job_spec(), ["n1"])
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n1 is unhealthy: nic:eth0 faulty"))
    answer = site.agents.hold = asyncio.Event()
    first = asyncio.ensure_future(site.launcher.dispatcher.dispatch_once())
    while not site.agents.stops():
        await asyncio.sleep(0)
    await site.dispatch()  # long after, the agent still has not answered
    assert len(site.agents.stops()) == 1
    answer.set()
    await first


# --- J12: a lost node is given up at once --------------------------------------------------------------------


async def test_processes_on_a_lost_node_are_given_up_at_once(site: Site) -> None:
    await site.run(job_spec(2), ["n1", "n2"])
    site.agents.unreachable.add("n2")
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n2 was lost: no heartbeat for 12s",
                                     lost_nodes=["n2"]))
    await site.dispatch()
    [lost] = site.recorded(NodeProcessLost)
    assert (lost.rank, lost.node, lost.reason) == (1, "n2", "node n2 was lost")
    # n1 is stopped gracefully; n2 is only asked to end what was given up there, should it come back.
    assert [(node, r.grace_seconds > 0) for node, r, _ in site.agents.stops()] == [("n1", True), ("n2", False)]
    assert site.recorded(LaunchStopped) == []  # rank 0 still runs
    await site.exited(0, "n1", 143)
    await site.dispatch()
    assert [e.attempt for e in site.recorded(LaunchStopped)] == [1]


async def test_a_node_given_up_on_is_made_to_end_that_attempt_as_soon_as_it_answers(site: Site) -> None:
    await site.run(job_spec(2), ["n1", "n2"])
    site.agents.unreachable.add("n2")
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n2 was lost", lost_nodes=["n2"]))
    await site.dispatch()
    await site.exited(0, "n1", 143)
    for _ in range(3):  # n2 stays away: it is asked again and again
        await site.dispatch()
    fences = [request for node, request, _ in site.agents.stops() if node == "n2"]
    assert len(fences) == 4 and site.recorded(LostProcessesStopped) == []
    # At once, without the checkpoint signal: the next attempt may already be writing its checkpoints.
    assert all((r.attempt, r.grace_seconds, r.checkpoint_signal) == (1, 0, None) for r in fences)

    site.agents.unreachable.discard("n2")  # the node is back
    await site.dispatch()

    assert [(e.attempt, e.node) for e in site.recorded(LostProcessesStopped)] == [(1, "n2")]
    asked = len(site.agents.stops())
    await site.dispatch()
    assert len(site.agents.stops()) == asked  # and never asked again, also by a restarted launcher
    restarted = Launcher(fake_runtime(site.log, "launcher"), CLUSTER)
    for envelope in site.log.envelopes:
        if envelope.service == "launcher":
            restarted.state.apply(envelope)
    assert restarted.state.fences == set()


# --- J13: a failed attempt is reported stopped before its restart --------------------------------------------


async def test_a_failed_attempt_awaiting_its_restart_is_reported_stopped(site: Site) -> None:
    await site.run(plain_spec(2, fault_restart=FaultRestart(max_restarts=2)), ["n1", "n2"])
    await site.exited(1, "n2", 3)
    [failed] = site.recorded(LaunchFailed)
    assert failed.exit_code == 3
    await site.scheduler(JobRestarting(job_id=JOB, attempt=1, restarts=1, reason=failed.reason, exit_code=3))
    await site.dispatch()
    assert sorted(node for node, _, _ in site.agents.stops()) == ["n1", "n2"]
    assert site.recorded(LaunchStopped) == []  # rank 0 has not exited yet
    await site.exited(0, "n1", 143)
    await site.dispatch()
    await site.dispatch()
    assert [e.attempt for e in site.recorded(LaunchStopped)] == [1]
    # The next attempt starts on the same nodes.
    await site.run(plain_spec(2), ["n1", "n2"], attempt=2)
    assert [(s.attempt, s.launch.node) for s in site.agents.starts()][-2:] == [(2, "n1"), (2, "n2")]


async def test_a_failed_attempt_that_ends_the_job_is_not_reported_stopped(site: Site) -> None:
    await site.run(plain_spec(2), ["n1", "n2"])
    await site.exited(1, "n2", 3)
    await site.scheduler(JobFailed(job_id=JOB, reason="rank 1 on n2 exited with code 3", exit_code=3))
    await site.dispatch()
    assert "n1" in [node for node, _, _ in site.agents.stops()]  # what still runs is stopped
    await site.exited(0, "n1", 143)
    await site.dispatch()
    assert site.recorded(LaunchStopped) == []


# --- J12, J15: what the next attempt is told ------------------------------------------------------------------


async def test_the_next_attempt_is_told_how_often_the_job_resumed(site: Site) -> None:
    spec = job_spec(debug_terminal=DebugTerminal())
    await site.run(spec, ["n1"])
    await site.scheduler(JobResuming(job_id=JOB, attempt=1, reason="node n1 is unhealthy: board:0 faulty"))
    await site.dispatch()
    await site.exited(0, "n1", 143)
    await site.dispatch()
    await site.scheduler(JobRequeued(job_id=JOB, attempt=1, reason="node n1 is unhealthy: board:0 faulty",
                                     resumes=1))
    await site.run(spec, ["n2"], attempt=2)
    plan = site.recorded(LaunchPlanned)[-1]
    [launch] = launches(plan)
    assert (plan.attempt, launch.env["TRAINYARD_RESUME_COUNT"], launch.keep_workspace) == (2, "1", True)
    # The new attempt's own checkpoint folder: the old attempt's processes cannot write into it.
    assert any(m.source == f"checkpoints/{JOB}/attempt-2" and m.target == "checkpoints" and not m.read_only
               for m in launch.mounts)


# --- the job token (MPI's remote shell) ---------------------------------------------------------------------


async def test_every_node_of_an_attempt_gets_one_job_token_also_from_a_restarted_launcher(site: Site) -> None:
    await site.run(plain_spec(2), ["n1", "n2"])
    restarted = Launcher(fake_runtime(site.log, "launcher"), CLUSTER)
    for envelope in site.log.envelopes:
        if envelope.service == "launcher":
            restarted.state.apply(envelope)

    [first, second] = site.agents.starts()
    again = restarted.dispatcher._job_token(restarted.state.launches[JOB])

    assert first.job_token and first.job_token == second.job_token == again
    secret = fake_runtime(site.log, "launcher").settings.require_auth_secret()
    claims = jwt.decode(first.job_token, secret, algorithms=["HS256"], options={"verify_exp": False})
    planned = next(e for e in site.log.envelopes if isinstance(e.event, LaunchPlanned))
    assert (claims["job"], claims["attempt"], claims["nodes"]) == (JOB, 1, ["n1", "n2"])
    assert claims["iat"] == int(planned.recorded_at.timestamp())  # issued when planned: the log's clock


async def test_a_rank_that_could_not_start_for_its_nodes_fault_names_the_node_in_the_failure(site: Site) -> None:
    await site.run(plain_spec(nodes=2), ["n1", "n2"])
    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=1, node="n2", exit_code=127,
                                    node_fault="data preparation failed on node n2: cannot write /c: disk full"))
    [failed] = site.recorded(LaunchFailed)
    assert failed.fault_nodes == ["n2"]
    assert failed.reason == "rank 1 could not start: data preparation failed on node n2: cannot write /c: disk full"


async def test_a_rank_that_could_not_start_for_its_jobs_own_fault_says_why_and_blames_no_node(site: Site) -> None:
    await site.run(plain_spec(nodes=2), ["n1", "n2"])
    why = "data preparation failed on node n2: refused datasets/x/l: a link that leads out of the dataset (to /s)"
    await site.report(ProcessExited(job_id=JOB, attempt=1, rank=1, node="n2", exit_code=127, not_started=why))
    [failed] = site.recorded(LaunchFailed)
    assert failed.fault_nodes == []
    assert failed.reason == f"rank 1 could not start: {why}"


# --- passes between the passes over every launch --------------------------------------------------------------


async def test_a_pass_between_full_ones_acts_on_what_changed_at_once(site: Site) -> None:
    """Between the passes over every launch under way (once a second), a pass looks at the launches that changed:
    a job asked to stop is stopped at once, and a job whose nodes chose their ports is planned and started in the
    pass that plans it."""
    await site.run(plain_spec(), ["n1"])  # full passes: the test's clock moves on a minute before each
    dispatcher, calls = site.launcher.dispatcher, len(site.agents.calls)
    await dispatcher.dispatch_once()  # from here the clock stands still
    assert len(site.agents.calls) == calls  # nothing changed, nothing sent
    await site.scheduler(JobStopRequested(job_id=JOB, by="alice"))
    await site.scheduler(JobSubmitted(job_id=OTHER, spec=plain_spec(2), creator="alice"))
    await site.scheduler(JobAdmitted(job_id=OTHER, attempt=1, flavor="cpu-4", placement=[
        Placement(rank=rank, node=node, address=f"addr-{node}", slots=1) for rank, node in enumerate(["n2", "n3"])]))
    await dispatcher.dispatch_once()  # the stop, and the ports asked of OTHER's nodes
    assert [node for node, _, _ in site.agents.stops()] == ["n1"]
    assert not [start for start in site.agents.starts() if start.job_id == OTHER]
    await dispatcher.dispatch_once()  # OTHER planned with its ports, and started
    assert sorted(start.launch.node for start in site.agents.starts() if start.job_id == OTHER) == ["n2", "n3"]
