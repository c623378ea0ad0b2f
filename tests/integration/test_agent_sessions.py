"""Kept environments and debug sessions (SPEC J15), and pre-checks (M1), against a real node agent.

The agent runs in the test's process on real NATS; the monitor's side (registration) is a stub.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.isolation.workspace import BACKEND_VARIABLE, BWRAP, PLAIN, bwrap_problem
from agent.ranks.kept import rank_root
from client.cli.commands.execute import PIPED_SHELL
from libs.contracts import subjects
from libs.contracts.agent import (
    Heartbeat,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    ProcessStarted,
    Released,
    ReleaseWorkspaces,
    SessionControl,
    SessionOpened,
    StartProcess,
)
from libs.contracts.codec import decode
from libs.contracts.events import Mount, NodeLaunch
from libs.contracts.operations.base import CommandError
from libs.messaging.rpc import call
from tests.support.agents import LAUNCHER, MONITOR, WAIT_SECONDS, Node, registered_node, start_agent

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-5e5510aa0001"


@pytest_asyncio.fixture(loop_scope="session", params=[PLAIN, BWRAP])
async def node(request: pytest.FixtureRequest, nc: Client, nats_url: str, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    if request.param == BWRAP and (problem := bwrap_problem()):
        pytest.skip(problem)
    monkeypatch.setenv(BACKEND_VARIABLE, request.param)
    storage = tmp_path / "storage"
    (storage / "algorithms" / "demo").mkdir(parents=True)
    (storage / "algorithms" / "demo" / "hello.txt").write_text("hello from storage\n")
    async with registered_node(nc, nats_url, tmp_path, job_id=JOB) as found:
        yield found


def launch(node: Node, code: str, *, keep: bool, rank: int = 0) -> NodeLaunch:
    return NodeLaunch(rank=rank, node=node.name, address="127.0.0.1", argv=[sys.executable, "-c", code],
                      env={"GREETING": "forty-two", "DATA": "/workspace/algorithm/hello.txt"},
                      mounts=[Mount(source="algorithms/demo", target="algorithm", read_only=True),
                              Mount(source="outputs/demo", target="outputs", read_only=False)],
                      keep_workspace=keep)


FAILING_JOB = "open('/workspace/outputs/result.txt'.replace('/workspace', __import__('os').environ" \
              "['TRAINYARD_WORKSPACE']), 'w').write('written by the job\\n'); raise SystemExit(3)"


async def test_a_command_session_runs_in_the_kept_environment_of_a_failed_job(node: Node) -> None:
    assert await node.run(launch(node, FAILING_JOB, keep=True)) == 3

    session = node.session()
    opened = await session.open(attempt=1, rank=0, command='cat "$DATA"; echo "greeting=$GREETING"; '
                                                            'cat /workspace/outputs/result.txt "$TRAINYARD_WORKSPACE'
                                                            '/outputs/result.txt" 2>/dev/null | head -1; '
                                                            'read line; echo "typed=$line"; exit 7')
    assert isinstance(opened, SessionOpened), opened
    await session.type("some input\n")
    await session.control(SessionControl(close=True))

    assert await session.exit_code() == 7
    assert session.text.splitlines() == ["hello from storage", "greeting=forty-two", "written by the job",
                                         "typed=some input"]


async def test_a_piped_shell_runs_what_it_is_given_and_ends_with_its_input(node: Node) -> None:
    """`trainyard exec JOB < script.sh` (no terminal, no command): the script runs, then the session ends."""
    assert await node.run(launch(node, FAILING_JOB, keep=True)) == 3
    session = node.session()
    opened = await session.open(attempt=1, rank=0, command=PIPED_SHELL)
    assert isinstance(opened, SessionOpened), opened

    await session.type('echo "greeting=$GREETING"\n')
    await session.control(SessionControl(close=True))

    assert await session.exit_code() == 0
    assert session.text.splitlines() == ["greeting=forty-two"]


async def test_a_kept_environment_outlives_a_restart_of_the_agent(node: Node, nc: Client, nats_url: str,
                                                                  tmp_path: Path) -> None:
    assert await node.run(launch(node, FAILING_JOB, keep=True)) == 3
    await node.agent.close()
    node.agent = await start_agent(nats_url, node.name, tmp_path)

    session = node.session()
    assert isinstance(await session.open(attempt=1, rank=0, command='cat "$DATA"'), SessionOpened)
    assert await session.exit_code() == 0
    assert session.text == "hello from storage\n"


async def test_a_running_job_adopted_by_a_restarted_agent_takes_sessions_in_its_environment(
        node: Node, nats_url: str, tmp_path: Path) -> None:
    await call(node.nc, subjects.agent_start(node.name),
               StartProcess(job_id=JOB, attempt=2, launch=launch(node, "import time; time.sleep(600)", keep=False)),
               reply_type=ProcessAccepted, signer=LAUNCHER)
    await node.report(ProcessStarted, attempt=2)
    await node.agent.close()
    node.agent = await start_agent(nats_url, node.name, tmp_path)
    try:
        session = node.session()
        assert isinstance(await session.open(attempt=2, rank=0, command='echo "$GREETING"; cat "$DATA"'),
                          SessionOpened)
        assert await session.exit_code() == 0
        assert session.text == "forty-two\nhello from storage\n"
    finally:
        adopted = node.agent.ranks.nodes[(JOB, 2, 0, 0)].group
        assert adopted is not None
        adopted.signal(signal.SIGKILL)


async def test_an_interactive_session_echoes_what_is_typed_on_a_terminal(node: Node) -> None:
    assert await node.run(launch(node, FAILING_JOB, keep=True)) == 3

    session = node.session()
    opened = await session.open(attempt=1, rank=0, columns=120, rows=30)
    assert isinstance(opened, SessionOpened), opened
    await session.type("echo answer-$((6 * 7)) $GREETING\n")
    await session.until_output("answer-42 forty-two")  # computed by the shell, not the echo of the keys
    await session.control(SessionControl(columns=100, rows=40))
    await session.type("stty size\n")
    await session.until_output("40 100")
    await session.type("sh -c 'echo waiting-$((2 + 3)); exec sleep 600'; echo finished-$((8 * 8))\n")
    await session.until_output("waiting-5")
    await session.type("\x03")  # Ctrl-C reaches the program in the foreground
    await session.type("echo after-$((1 + 1))\n")
    await session.until_output("after-2")
    assert "finished-64" not in session.text  # the interrupted line did not go on
    await session.type("exit 5\n")

    assert await session.exit_code() == 5


async def test_a_released_environment_is_gone_and_refuses_sessions(node: Node) -> None:
    assert await node.run(launch(node, FAILING_JOB, keep=True, rank=0)) == 3
    assert await node.run(launch(node, FAILING_JOB, keep=True, rank=1)) == 3
    root = rank_root(node.agent.root, JOB, 1, 0, 0)
    assert root.is_dir()
    idle = node.session()
    assert isinstance(await idle.open(attempt=1, rank=0, command="sleep 600"), SessionOpened)

    released = await call(node.nc, subjects.agent_release(node.name), ReleaseWorkspaces(job_id=JOB),
                          reply_type=Released | CommandError, signer=MONITOR)

    assert released == Released(removed=2)
    assert not root.exists() and not rank_root(node.agent.root, JOB, 1, 0, 1).exists()
    assert await idle.exit_code() == 137  # a session in it ends with it
    # Shared storage is untouched: the workspace's links were removed, not followed.
    assert (node.storage / "algorithms" / "demo" / "hello.txt").read_text() == "hello from storage\n"
    assert (node.storage / "outputs" / "demo" / "result.txt").read_text() == "written by the job\n"
    refused = await node.session().open(attempt=1, rank=0, command="true")
    assert isinstance(refused, CommandError)
    assert refused.code == "not-found"
    assert f"job {JOB} attempt 1 task 0 rank 0" in refused.message
    again = await call(node.nc, subjects.agent_release(node.name), ReleaseWorkspaces(job_id=JOB),
                       reply_type=Released | CommandError, signer=MONITOR)
    assert again == Released(removed=0)


async def test_a_workspace_not_kept_is_removed_once_the_process_ended(node: Node) -> None:
    assert await node.run(launch(node, FAILING_JOB, keep=False)) == 3

    async with asyncio.timeout(WAIT_SECONDS):  # removed right after the exit was reported
        while rank_root(node.agent.root, JOB, 1, 0, 0).exists():
            await asyncio.sleep(0.05)
    assert list((node.agent.root / "jobs").iterdir()) == []
    assert (node.storage / "outputs" / "demo" / "result.txt").read_text() == "written by the job\n"
    assert (node.storage / "algorithms" / "demo" / "hello.txt").exists()
    refused = await node.session().open(attempt=1, rank=0, command="true")
    assert isinstance(refused, CommandError) and refused.code == "not-found"


async def test_a_session_in_a_running_job_and_one_left_idle(node: Node) -> None:
    await call(node.nc, subjects.agent_start(node.name),
               StartProcess(job_id=JOB, attempt=2, launch=launch(node, "import time; time.sleep(600)", keep=False)),
               reply_type=ProcessAccepted, signer=LAUNCHER)
    session = node.session()
    async with asyncio.timeout(WAIT_SECONDS):
        while not isinstance(opened := await session.open(attempt=2, rank=0, command="echo $TRAINYARD_ATTEMPT; "
                                                          "sleep 600", idle_seconds=2.0), SessionOpened):
            assert opened.code == "not-found"  # not started yet
            await asyncio.sleep(0.05)
    # Kept alive until its command printed, however slowly its shell started; left idle from then on.
    async with asyncio.timeout(WAIT_SECONDS):
        while b"2\n" not in session.out:
            await session.control(SessionControl())
            await asyncio.sleep(0.1)

    assert await session.exit_code() == 137  # no keep-alive came: the session was ended


async def test_the_precheck_and_heartbeats_carry_the_node_health(node: Node) -> None:
    report = await call(node.nc, subjects.agent_precheck(node.name),
                        PrecheckNode(job_id=JOB, cpus=1, memory_mib=1, accelerators=1),
                        reply_type=PrecheckReport | CommandError, signer=MONITOR)
    assert isinstance(report, PrecheckReport)
    checks = {c.key: c for c in report.checks}
    assert checks["runtime:storage"].healthy and checks["runtime:memory"].healthy and checks["nic:lo"].healthy
    assert not checks["board:count"].healthy  # the node has no boards

    beats: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def heard(msg: Msg) -> None:
        beats.put_nowait(decode(msg.data, Heartbeat))

    subscription = await node.nc.subscribe(subjects.heartbeat(node.name), cb=heard)
    async with asyncio.timeout(WAIT_SECONDS):
        beat = await beats.get()
    await subscription.unsubscribe()
    assert {"nic:lo", "runtime:storage", "runtime:disk", "runtime:python"} <= {c.key for c in beat.health}

    bad = await node.ask(subjects.agent_precheck, b'{"type": "PrecheckNode.v1"}')
    assert isinstance(bad, CommandError) and bad.code == "invalid-request"
