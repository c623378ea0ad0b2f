"""Long runs surviving hardware, on real processes (J12, J13, J15, M1–M7).

A 2-node PyTorch job saves a checkpoint on the platform's signal and resumes from it on healthy
nodes, after a marked board fault and after its node agent is killed; a failing command is
restarted up to its maximum; slow iterations raise one alert (and, if asked, move the job); a
failed job's environment is kept for the debug terminal and cleaned up after its retention.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from agent.ranks.kept import kept_roots
from client.api import TrainyardError
from devstack.harness import TESTER_EMAIL
from libs.contracts.events import AlertRaised, JobResuming, LostProcessesStopped
from libs.contracts.jobspec import (
    AlgorithmRef,
    DebugTerminal,
    FaultRestart,
    JobSpec,
    OutputRef,
    PerformanceDetection,
)
from tests.support.mailbox import Mailbox
from tests.support.specs import resumable
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]
RESILIENT = Path(__file__).parent / "cluster-resilient.yaml"


def flaky(name: str, *, failures: int, max_restarts: int) -> JobSpec:
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="flaky"), output=OutputRef(name=name),
                   command=f"python3 flaky.py {failures}", fault_restart=FaultRestart(max_restarts=max_restarts))


async def wait_for_line(stack: Stack, job_id: str, pattern: str, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while not any(re.search(pattern, line) for line in await stack.logs(job_id)):
            await asyncio.sleep(0.5)


def numbers(lines: list[str], pattern: str) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.search(pattern, line))]


def steps_after_resume(lines: list[str], rank: int) -> list[int]:
    """The step numbers rank `rank` printed after it resumed."""
    mine = [line for line in lines if line.startswith(f"[{rank}] ")]
    start = next(i for i, line in enumerate(mine) if "resumed from step" in line)
    return numbers(mine[start:], rf"^\[{rank}\] rank {rank} step (\d+) ")


async def event_names(stack: Stack, job_id: str) -> list[str]:
    return [type(e.event).name() for e in await (await stack.api()).history(job_id)]


async def assert_resumed_once_from_its_checkpoint(stack: Stack, job_id: str, left: str) -> None:
    ended = await stack.wait_until(job_id, "ended", timeout=300)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 1
    assert left not in {p.node for p in ended.placement}
    lines = await stack.logs(job_id)
    saved = numbers(lines, r"^\[0\] rank 0 saved a checkpoint at step (\d+) ")
    resumed = numbers(lines, r"^\[0\] rank 0 resumed from step (\d+)")
    assert len(saved) == 1 and resumed == saved, (saved, resumed)
    # It went on from the saved step, not from the beginning, and finished.
    assert steps_after_resume(lines, 0)[:1] == [saved[0] + 1]
    assert any(line == "[0] rank 0 finished at step 60" for line in lines)
    names = await event_names(stack, job_id)
    # M1: each attempt was pre-checked on its nodes, and that is in the job's events.
    assert names.count("PrecheckCompleted") == 2
    assert names.index("JobResuming") < names.index("LaunchStopped") < names.index("JobRequeued")


@pytest.mark.cluster(RESILIENT)
async def test_a_checkpoint_job_leaves_a_faulty_board_and_resumes_from_its_checkpoint(stack: Stack) -> None:
    api = await stack.up()
    job = await api.submit(resumable("board-drill"))
    running = await stack.wait_until(job.job_id, "running", timeout=120)
    await wait_for_line(stack, job.job_id, r"^\[0\] rank 0 step 5 ")
    faulty = running.placement[0].node  # the master's node: the hardest one to lose

    await api.mark_component(faulty, "board:0", reason="drill")

    await assert_resumed_once_from_its_checkpoint(stack, job.job_id, left=faulty)
    nodes = {n.info.name: n for n in await api.nodes()}
    assert nodes[faulty].status == "unhealthy"
    assert any("board:0" in problem for problem in nodes[faulty].problems)


@pytest.mark.cluster(RESILIENT)
async def test_a_checkpoint_job_survives_its_node_agent_killed(stack: Stack) -> None:
    api = await stack.up()
    job = await api.submit(resumable("lost-node"))
    running = await stack.wait_until(job.job_id, "running", timeout=120)
    await wait_for_line(stack, job.job_id, r"^\[0\] rank 0 step 5 ")
    lost = running.placement[1].node

    stack.crash(f"agent-{lost}")  # kill -9: its heartbeats stop

    await assert_resumed_once_from_its_checkpoint(stack, job.job_id, left=lost)
    reasons = [e.event.reason for e in await api.history(job.job_id) if isinstance(e.event, JobResuming)]
    assert f"node {lost} was lost" in reasons[0]


async def test_a_failing_command_is_restarted_up_to_its_maximum(stack: Stack) -> None:
    api = await stack.up()
    recovers = await api.submit(flaky("recovers", failures=2, max_restarts=3))
    gives_up = await api.submit(flaky("gives-up", failures=2, max_restarts=1))

    ended = await stack.wait_until(recovers.job_id, "ended", timeout=120)
    assert ended.status == "succeeded", ended.reason
    assert ended.restarts == 2
    assert (await event_names(stack, recovers.job_id)).count("JobRestarting") == 2

    failed = await stack.wait_until(gives_up.job_id, "ended", timeout=120)
    assert failed.status == "failed"
    assert failed.exit_code == 3
    assert failed.restarts == 1
    assert "restart" in (failed.reason or "")


async def alerts(stack: Stack, job_id: str) -> list[AlertRaised]:
    """The alerts about the job as people see them (`trainyard alerts`: the monitor's ListAlerts, M7)."""
    found = []
    async for envelope in (await stack.api()).alerts():
        if isinstance(envelope.event, AlertRaised) and envelope.event.job_id == job_id:
            found.append(envelope.event)
    return found


async def wait_for_mail(mailbox: Mailbox, count: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while len(mailbox.messages) < count:
            await asyncio.sleep(0.2)


@pytest.mark.cluster(RESILIENT)
async def test_slow_iterations_raise_one_alert_by_mail_and_on_nats(stack: Stack, mailbox: Mailbox) -> None:
    api = await stack.up()
    detection = PerformanceDetection(threshold=0.8, window=5, action="alert")
    job = await api.submit(resumable("slow-board", nodes=1, steps=40, extra="--slow-after 10",
                                     performance=detection))
    ended = await stack.wait_until(job.job_id, "ended", timeout=180)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 0  # alert only: the job was left alone

    raised = await alerts(stack, job.job_id)
    assert [a.kind for a in raised] == ["performance"]  # one incident, thirty slow lines
    await wait_for_mail(mailbox, 1)
    await asyncio.sleep(2)  # a second mail would have had time to arrive
    assert len(mailbox.messages) == 1
    assert TESTER_EMAIL in mailbox.messages[0].rcpt_tos
    assert (await event_names(stack, job.job_id)).count("PerformanceDegraded") == 1


@pytest.mark.cluster(RESILIENT)
async def test_slow_iterations_with_reschedule_move_the_job_off_the_slow_node(stack: Stack, mailbox: Mailbox) -> None:
    api = await stack.up()
    detection = PerformanceDetection(threshold=0.8, window=5, action="reschedule")
    job = await api.submit(resumable("moves-away", nodes=1, steps=60, extra="--slow-after 10",
                                     performance=detection))
    running = await stack.wait_until(job.job_id, "running", timeout=120)
    slow = running.placement[0].node

    ended = await stack.wait_until(job.job_id, "ended", timeout=240)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 1
    assert slow in ended.excluded_nodes
    assert slow not in {p.node for p in ended.placement}
    kinds = [a.kind for a in await alerts(stack, job.job_id)]
    assert kinds.count("performance") == 1
    await wait_for_mail(mailbox, len(kinds))
    assert len(mailbox.messages) == len(kinds)  # one mail per alert


async def test_a_failed_jobs_environment_is_kept_for_the_debug_terminal_then_removed(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="debug-me", flavors=["cpu-1"], algorithm=AlgorithmRef(name="sleeper"),
                   output=OutputRef(name="debug-me"), command="python3 run.py --seconds 0.5 --exit-code 4",
                   debug_terminal=DebugTerminal(retention="20s"))
    job = await api.submit(spec)
    ended = await stack.wait_until(job.job_id, "ended", timeout=60)
    assert ended.status == "failed"
    async with asyncio.timeout(120):
        while (await api.get_job(job.job_id)).job.kept_until is None:
            await asyncio.sleep(0.2)

    code, output = await api.run_in_job(job.job_id, 'ls "$TRAINYARD_WORKSPACE/algorithm"; echo "job $TRAINYARD_JOB_ID"')
    assert code == 0
    assert "run.py" in output.decode()
    assert f"job {job.job_id}" in output.decode()
    code, _ = await api.run_in_job(job.job_id, "exit 7")
    assert code == 7

    node = ended.placement[0].node
    agent_root = stack.home / "agents" / node
    assert kept_roots(agent_root, job.job_id)
    async with asyncio.timeout(90):  # retention 20 s, then the monitor releases it
        while kept_roots(agent_root, job.job_id):
            await asyncio.sleep(0.5)
    with pytest.raises(TrainyardError) as refused:
        await api.run_in_job(job.job_id, "true")
    assert refused.value.error.code == "invalid-state"


@pytest.mark.cluster(RESILIENT)
async def test_an_agent_back_after_its_node_was_lost_ends_the_old_attempt_at_once(stack: Stack) -> None:
    """A paused agent (hung, or cut off) is declared lost and its job resumes elsewhere; when it comes back,
    the launcher has it end the given-up attempt before anything else, so two attempts never run on."""
    api = await stack.up()
    job = await api.submit(resumable("paused-node"))
    running = await stack.wait_until(job.job_id, "running", timeout=120)
    await wait_for_line(stack, job.job_id, r"^\[0\] rank 0 step 5 ")
    paused = running.placement[1].node

    stack.pause(f"agent-{paused}")
    async with asyncio.timeout(120):  # resumed on other nodes, the paused one's rank given up
        while "JobRequeued" not in await event_names(stack, job.job_id):
            await asyncio.sleep(0.5)
    stack.resume(f"agent-{paused}")

    async with asyncio.timeout(120):
        while True:
            fenced = [e.event for e in await api.history(job.job_id) if isinstance(e.event, LostProcessesStopped)]
            if fenced:
                break
            await asyncio.sleep(0.2)
    assert [(e.attempt, e.node) for e in fenced] == [(1, paused)]
    ended = await stack.wait_until(job.job_id, "ended", timeout=300)
    assert ended.status == "succeeded", ended.reason
    assert ended.resumes == 1 and paused not in {p.node for p in ended.placement}
