"""Debug sessions (J15) and alerts (M7) against a real NATS server: the test plays the monitor (it
answers OpenTerminal) and the node agent (it speaks on the session's subjects), so what is checked is
what a user sees: every byte of output, in order, even what the agent writes before the monitor's
reply, and the command's exit code."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import re
import signal
import struct
import termios
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from typer.testing import CliRunner

from client import cli, terminal
from client.api import TrainyardClient
from client.cli.commands.execute import PIPED_SHELL
from libs.auth import issue_token
from libs.contracts import subjects
from libs.contracts.agent import SessionControl, SessionExited
from libs.contracts.codec import decode, encode
from libs.contracts.events import AlertMailed, AlertRaised, EventEnvelope
from libs.contracts.identity import AUTH_HEADER, Identity
from libs.contracts.operations.alerts import LIST_ALERTS, ListAlerts
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import OPEN_TERMINAL, OpenTerminal, TerminalOpened
from libs.jobstatus import JobLifecycle
from libs.messaging import debug_session
from libs.messaging.connection import round_trip
from services.monitor.alerts import page as alert_page
from tests.support.waiting import eventually

JOB = "job-0123456789ab"
TOKEN = issue_token("client-terminal-tests-" * 3, Identity(user="alice", projects=["default"]))
OWNER = "user-alice"  # whom NATS knows alice's client as: her sessions' subjects name it
runner = CliRunner()


class FakeNode:
    """The monitor and one node agent. The agent writes `early` before the monitor replies, then,
    once input is closed, `got:<input>` and the exit code; another session's output goes by too."""

    def __init__(self, nc: Client, *, exit_code: int = 0, early: bytes = b"early\n",
                 refusal: CommandError | None = None, session_id: str = "s1", node: str = "node-a") -> None:
        self.nc = nc
        self.exit_code = exit_code
        self.early = early
        self.refusal = refusal
        self.session_id = session_id
        self.node = node
        self.requests: list[OpenTerminal] = []
        self.headers: list[dict[str, str]] = []
        self.input = bytearray()
        self.controls: list[SessionControl] = []
        self.hold = asyncio.Event()  # set: the agent may exit once input is closed
        self.hold.set()

    def subject(self, channel: str) -> str:
        return subjects.session(self.node, OWNER, self.session_id, channel)

    async def start(self) -> None:
        await self.nc.subscribe(OPEN_TERMINAL.subject, cb=self.on_open)
        await self.nc.subscribe(subjects.session(self.node, "*", "*", "in"), cb=self.on_input)
        await self.nc.subscribe(subjects.session(self.node, "*", "*", "control"), cb=self.on_control)
        await round_trip(self.nc)

    async def on_open(self, msg: Msg) -> None:
        request = decode(msg.data, OpenTerminal)
        self.requests.append(request)
        self.headers.append(dict(msg.headers or {}))
        # As the monitor does: the client's own session id, when it chose one.
        self.session_id = request.session_id or self.session_id
        if self.refusal is not None:
            await msg.respond(encode(self.refusal))
            return
        await self.nc.publish(subjects.session("node-z", OWNER, "other", "out"), b"someone else's output\n")
        await self.nc.publish(self.subject("out"), self.early)
        await round_trip(self.nc)
        await asyncio.sleep(0.2)  # the early output is surely there before the reply
        await msg.respond(encode(TerminalOpened(session_id=self.session_id, node=self.node, rank=0, attempt=2)))

    async def on_input(self, msg: Msg) -> None:
        if msg.subject == self.subject("in"):
            self.input += msg.data

    async def on_control(self, msg: Msg) -> None:
        if msg.subject != self.subject("control"):
            return
        control = decode(msg.data, SessionControl)
        self.controls.append(control)
        if control.close:
            asyncio.get_running_loop().create_task(self.finish())

    async def finish(self) -> None:
        await self.hold.wait()
        await self.nc.publish(self.subject("out"), b"got:" + bytes(self.input))
        await self.nc.publish(self.subject("exit"), encode(SessionExited(exit_code=self.exit_code)))


@contextlib.asynccontextmanager
async def fake_node(nats_url: str, **options: Any) -> AsyncIterator[FakeNode]:
    nc = await nats.connect(nats_url)
    node = FakeNode(nc, **options)
    await node.start()
    try:
        yield node
    finally:
        await nc.close()


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, nats_url: str, tmp_path: Path) -> None:
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("TRAINYARD_TOKEN", TOKEN)
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))


async def invoke(*args: str, input: str | None = None) -> Any:
    # The CLI runs its own event loop; a thread keeps this one free to play the monitor and agent.
    return await asyncio.to_thread(runner.invoke, cli.app, list(args), input=input)


# --- the Python client ------------------------------------------------------------------------------------


async def test_run_in_job_returns_every_byte_and_the_exit_code(nats_url: str) -> None:
    async with fake_node(nats_url, exit_code=3) as node:
        client = await TrainyardClient.open(nats_url, token=TOKEN)
        try:
            code, output = await client.run_in_job(JOB, ["sh", "-c", "echo hi; exit 3"], input=b"data")
        finally:
            await client.close()
    assert (code, output) == (3, b"early\ngot:data")
    assert node.requests == [OpenTerminal(job_id=JOB, command="sh -c 'echo hi; exit 3'",
                                          session_id=node.session_id)]
    assert re.fullmatch("[0-9a-f]{32}", node.session_id)  # chosen by the client, unguessable
    assert node.headers[0][AUTH_HEADER] == f"Bearer {TOKEN}"


async def test_a_long_command_is_kept_alive(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debug_session, "KEEPALIVE_SECONDS", 0.05)
    async with fake_node(nats_url) as node:
        node.hold.clear()
        client = await TrainyardClient.open(nats_url, token=TOKEN)
        try:
            running = asyncio.create_task(client.run_in_job(JOB, "sleep 600"))

            async def kept_alive() -> bool:  # three keep-alives came while the command ran, however slowly
                return node.controls.count(SessionControl()) >= 3

            await eventually(kept_alive)
            node.hold.set()
            assert await running == (0, b"early\ngot:")
        finally:
            await client.close()
    assert node.controls[0] == SessionControl(close=True)
    assert node.controls.count(SessionControl()) >= 3


async def test_run_in_job_times_out(nats_url: str) -> None:
    async with fake_node(nats_url) as node:
        node.hold.clear()
        client = await TrainyardClient.open(nats_url, token=TOKEN)
        try:
            with pytest.raises(TimeoutError):
                await client.run_in_job(JOB, "sleep 600", timeout=0.3)
        finally:
            await client.close()


# --- trainyard exec -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cli_env")
async def test_exec_prints_the_output_and_exits_with_the_commands_code(nats_url: str) -> None:
    async with fake_node(nats_url, exit_code=3) as node:
        result = await invoke("exec", JOB, "--node", "node-a", "--", "python3", "-c", "print('a b')",
                              input="piped input")
    assert result.exit_code == 3, result.output
    assert result.stdout == "early\ngot:piped input"
    assert node.requests[0].command == "python3 -c 'print('\"'\"'a b'\"'\"')'"
    assert node.requests[0].node == "node-a"


@pytest.mark.usefixtures("cli_env")
async def test_exec_of_one_word_sends_it_as_the_shell_line(nats_url: str) -> None:
    async with fake_node(nats_url) as node:
        result = await invoke("exec", JOB, "--", "ls /workspace | head -3")
    assert result.exit_code == 0, result.output
    assert node.requests[0].command == "ls /workspace | head -3"


@pytest.mark.usefixtures("cli_env")
async def test_exec_without_a_command_or_a_terminal_runs_a_shell_on_what_is_piped(nats_url: str) -> None:
    async with fake_node(nats_url, exit_code=0) as node:
        result = await invoke("exec", JOB, input="ls\nexit\n")
    assert result.exit_code == 0, result.output
    # Not a terminal session, which would wait for typing after the input ended: a shell that ends with it.
    assert node.requests[0].command == PIPED_SHELL
    assert bytes(node.input) == b"ls\nexit\n"
    assert "got:ls\nexit\n" in result.stdout


@pytest.mark.usefixtures("cli_env")
async def test_exec_says_why_the_monitor_refused(nats_url: str) -> None:
    refusal = CommandError(code="invalid-state", message=f"{JOB} succeeded: no environment was kept",
                           hint="environments are kept only after an abnormal end with debug_terminal on")
    async with fake_node(nats_url, refusal=refusal):
        result = await invoke("exec", JOB, "--", "ls")
    assert result.exit_code == 1
    assert f"error: {JOB} succeeded: no environment was kept" in result.output
    assert "hint: environments are kept only after an abnormal end" in result.output


# --- the terminal: raw mode and its size --------------------------------------------------------------------


def set_size(fd: int, columns: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


async def test_a_shell_gets_the_terminal_raw_and_its_size_then_restores_it(nats_url: str) -> None:
    leader, follower = pty.openpty()
    set_size(follower, 100, 30)
    before = termios.tcgetattr(follower)
    output = bytearray()

    class Sink:
        def write(self, data: bytes) -> int:
            output.extend(data)
            return len(data)

        def flush(self) -> None:
            pass

    async with fake_node(nats_url, exit_code=0) as node:
        node.hold.clear()
        client = await TrainyardClient.open(nats_url, token=TOKEN)
        try:
            with os.fdopen(follower, "rb", buffering=0, closefd=False) as stdin:
                async with client.session(JOB) as session:
                    attached = asyncio.create_task(terminal.attach(session, stdin=stdin, raw=True,
                                                                   stdout=Sink()))  # type: ignore[arg-type]

                    async def attached_raw() -> bool:  # its size sent, its terminal raw
                        return (SessionControl(columns=100, rows=30) in node.controls
                                and termios.tcgetattr(follower)[3] & termios.ICANON == 0)

                    await eventually(attached_raw)
                    raw = termios.tcgetattr(follower)
                    set_size(follower, 120, 40)
                    os.kill(os.getpid(), signal.SIGWINCH)
                    os.write(leader, b"\x03")  # Ctrl-C goes to the remote shell, not to this process

                    async def resized_and_interrupted() -> bool:
                        return SessionControl(columns=120, rows=40) in node.controls and bytes(node.input) == b"\x03"

                    await eventually(resized_and_interrupted)
                    await node.nc.publish(node.subject("exit"), encode(SessionExited(exit_code=130)))
                    assert await attached == 130
            after = termios.tcgetattr(follower)
        finally:
            await client.close()
            os.close(leader)
            os.close(follower)
    assert raw[3] & termios.ICANON == 0 and raw[3] & termios.ECHO == 0  # raw while attached
    assert after == before  # and as it was afterwards
    assert SessionControl(columns=100, rows=30) in node.controls
    assert SessionControl(columns=120, rows=40) in node.controls
    assert bytes(node.input) == b"\x03"
    assert output == b"early\n"


def test_exit_status_reads_like_a_shells() -> None:
    assert [terminal.exit_status(code) for code in (0, 3, -9, 300)] == [0, 3, 137, 255]


def test_command_line_quotes_several_words_only() -> None:
    assert terminal.command_line([]) is None
    assert terminal.command_line(["ls -la | wc -l"]) == "ls -la | wc -l"
    assert terminal.command_line(["echo", "a b", "$HOME"]) == "echo 'a b' '$HOME'"


# --- alerts -------------------------------------------------------------------------------------------------


def envelope(position: int, event: AlertRaised | AlertMailed) -> EventEnvelope:
    return EventEnvelope(event_id=f"e{position}", service="monitor", aggregate_type="alert",
                         aggregate_id=event.alert_id, version=1, position=position,
                         recorded_at=datetime(2026, 11, 21, 13, 40, position, tzinfo=UTC), event=event)


class FakeMonitor:
    """Answers `ListAlerts` as the monitor does (services/monitor/alerts.page), for an administrator."""

    def __init__(self) -> None:
        self.raised: list[EventEnvelope] = []

    def add(self, position: int, event: AlertRaised | AlertMailed) -> None:
        if isinstance(event, AlertRaised):  # the monitor pages through what it raised
            self.raised.append(envelope(position, event))

    async def serve(self, nc: Any) -> None:
        async def answer(msg: Any) -> None:
            request = decode(msg.data, ListAlerts)
            admin = Identity(user="admin", projects=[], admin=True)
            await msg.respond(encode(alert_page(self.raised, request, admin, JobLifecycle())))

        await nc.subscribe(LIST_ALERTS.subject, cb=answer)
        await round_trip(nc)


RESUMING = AlertRaised(alert_id="a1", kind="job-resuming", title="job-0123456789ab resumes away from node-b",
                       message="board:0 faulty", job_id=JOB, node="node-b")
UNHEALTHY = AlertRaised(alert_id="a2", kind="node-unhealthy", title="node-c is unhealthy [board:1]",
                        message="board:1 faulty", node="node-c")


@pytest.mark.usefixtures("cli_env")
async def test_alerts_lists_raised_alerts_as_a_table(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        monitor = FakeMonitor()
        monitor.add(1, RESUMING)
        monitor.add(2, AlertMailed(alert_id="a1", recipients=["alice@example.com"]))
        monitor.add(3, UNHEALTHY)
        await monitor.serve(nc)
        result = await invoke("alerts")
    finally:
        await nc.close()
    assert result.exit_code == 0, result.output
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["TIME", "KIND", "JOB", "NODE", "TITLE"]
    rows = [line.split(None, 5) for line in lines]  # the time is a date and a clock time
    assert [[*row[2:5], row[5].strip()] for row in rows] == [["job-resuming", JOB, "node-b", RESUMING.title],
                                                              ["node-unhealthy", "-", "node-c", UNHEALTHY.title]]


async def test_following_alerts_gives_new_ones_as_they_come(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    client = await TrainyardClient.open(nats_url, token=TOKEN)
    try:
        monitor = FakeMonitor()
        monitor.add(1, RESUMING)
        await monitor.serve(nc)
        seen: list[str] = []

        async def follow() -> None:
            async for alert in client.alerts(follow=True, poll_seconds=0.1):
                assert isinstance(alert.event, AlertRaised)
                seen.append(alert.event.alert_id)
                if len(seen) == 2:
                    return

        following = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        monitor.add(2, UNHEALTHY)
        await asyncio.wait_for(following, 30)
    finally:
        await client.close()
        await nc.close()
    assert seen == ["a1", "a2"]
