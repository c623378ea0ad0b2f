"""Every request to a node agent gets an answer: a malformed start, stop or exec is refused with the
reason instead of being dropped, and changes nothing. Against a real agent on real NATS; the
monitor's side (registration) is a stub.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

import agent.ranks.runner as agent_module
from agent.isolation.workspace import BACKEND_VARIABLE, PLAIN
from libs.auth import bearer_headers
from libs.contracts import subjects
from libs.contracts.agent import (
    MAX_STARTS_PER_REQUEST,
    ExecExited,
    ExecInJob,
    PortsReserved,
    PrecheckNode,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    ReservePorts,
    StartProcess,
    StartProcesses,
    StartRefused,
    StartsAnswered,
    Stopped,
    StopProcesses,
    TracedStart,
)
from libs.contracts.codec import decode, encode
from libs.contracts.events import NodeLaunch
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlSigner
from libs.natsroles import job_inbox
from tests.support.agents import LAUNCHER, MONITOR, WAIT_SECONDS, Node, registered_node, signed

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-5e5510aa0002"
JOB_TOKEN = "the-token-of-job-5e5510aa0002-attempt-1"  # what the launcher gave the attempt; opaque to the agent
AS_THE_JOB = bearer_headers(JOB_TOKEN)
SLEEPER = "import time; time.sleep(600)"


@pytest_asyncio.fixture(loop_scope="session")
async def node(nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)

    async with registered_node(nc, nats_url, tmp_path, job_id=JOB, health_probe_seconds=60) as found:
        yield found


def start_request(code: str, attempt: int = 1) -> StartProcess:
    return StartProcess(job_id=JOB, attempt=attempt, job_token=JOB_TOKEN, launch=NodeLaunch(
        rank=0, node="n", address="127.0.0.1", argv=[sys.executable, "-c", code], env={}, mounts=[]))


def changed(request: msgspec.Struct, change: Callable[[dict[str, Any]], object]) -> bytes:
    """`request` as JSON, after `change` altered it."""
    raw = msgspec.to_builtins(request)
    change(raw)
    return msgspec.json.encode(raw)


MALFORMED_STARTS = {
    "not JSON": (b"start job-1 please", "not valid JSON"),
    "no launch": (changed(start_request("pass"), lambda raw: raw.pop("launch")), "launch: is required"),
    "a text attempt": (
        changed(start_request("pass"), lambda raw: raw.update(attempt="one")), "attempt: Expected `int`"),
    "another request type": (
        changed(start_request("pass"), lambda raw: raw.update(type="StopProcesses.v1")), "type: Invalid value"),
    "a job id that is a path": (
        changed(start_request("pass"), lambda raw: raw.update(job_id="../../etc")), "'../../etc' is not a job id"),
}


@pytest.mark.parametrize("payload, reason", MALFORMED_STARTS.values(), ids=MALFORMED_STARTS.keys())
async def test_a_malformed_start_is_refused_with_the_reason_and_starts_nothing(node: Node, payload: bytes,
                                                                              reason: str) -> None:
    refused = await node.ask(subjects.agent_start, payload)

    assert isinstance(refused, CommandError), refused
    assert refused.code == "invalid-request"
    assert reason in refused.message
    await asyncio.sleep(0.3)  # a process started by mistake would have reported by now
    assert node.nothing_started()


async def test_a_start_from_a_newer_launcher_with_a_field_this_agent_does_not_know_still_runs(node: Node) -> None:
    newer = changed(start_request("raise SystemExit(7)"), lambda raw: raw["launch"].update(niceness=5))

    assert await node.ask(subjects.agent_start, newer) == ProcessAccepted(already_known=False)
    exited = await node.report(ProcessExited)
    assert isinstance(exited, ProcessExited) and exited.exit_code == 7


async def test_a_good_start_still_runs_and_a_repeated_one_is_already_known(node: Node) -> None:
    assert isinstance(await node.ask(subjects.agent_start, b"{}"), CommandError)

    request = encode(start_request("raise SystemExit(6)"))
    assert await node.ask(subjects.agent_start, request) == ProcessAccepted(already_known=False)
    assert await node.ask(subjects.agent_start, request) == ProcessAccepted(already_known=True)

    exited = await node.report(ProcessExited)
    assert isinstance(exited, ProcessExited) and exited.exit_code == 6
    assert len(node.starts()) == 1


def starts_request(*starts: StartProcess, trace: dict[str, str] | None = None) -> bytes:
    return encode(StartProcesses(starts=[TracedStart(start=start, trace=trace or {}) for start in starts]))


async def test_starts_sent_together_each_run_once_and_are_answered_each_in_order(node: Node) -> None:
    first, second = start_request("raise SystemExit(3)", attempt=1), start_request("raise SystemExit(4)", attempt=2)
    answered = await node.ask(subjects.agent_starts, starts_request(first, second))
    assert answered == StartsAnswered(answers=[ProcessAccepted(already_known=False)] * 2)

    exits = {(await node.report(ProcessExited, attempt)).exit_code for attempt in (1, 2)}  # type: ignore[union-attr]
    assert exits == {3, 4}
    # Sent again (the launcher's resend of what it did not hear answered), alone or together: known, nothing runs.
    again = await node.ask(subjects.agent_starts, starts_request(second, first))
    assert again == StartsAnswered(answers=[ProcessAccepted(already_known=True)] * 2)
    assert await node.ask(subjects.agent_start, encode(first)) == ProcessAccepted(already_known=True)
    await asyncio.sleep(0.3)
    assert len(node.starts()) == 2


async def test_a_start_that_cannot_be_taken_is_refused_alone_and_the_others_run(node: Node) -> None:
    bad = StartProcess(job_id="../../etc", attempt=1, launch=start_request("pass").launch)
    answered = await node.ask(subjects.agent_starts, starts_request(bad, start_request("raise SystemExit(5)")))

    assert isinstance(answered, StartsAnswered)
    refused, accepted = answered.answers
    assert isinstance(refused, StartRefused) and refused.code == "invalid-request" and "not a job id" in refused.message
    assert accepted == ProcessAccepted(already_known=False)
    exited = await node.report(ProcessExited)
    assert isinstance(exited, ProcessExited) and exited.exit_code == 5 and len(node.starts()) == 1


BAD_BATCHES = {
    "no starts": (b'{"type": "StartProcesses.v1", "starts": []}', "of length >= 1"),
    "too many starts": (starts_request(*[start_request("pass", attempt=n) for n in range(MAX_STARTS_PER_REQUEST + 1)]),
                        f"of length <= {MAX_STARTS_PER_REQUEST}"),
}


@pytest.mark.parametrize("payload, reason", BAD_BATCHES.values(), ids=BAD_BATCHES.keys())
async def test_a_malformed_request_of_starts_is_refused_whole_and_starts_nothing(node: Node, payload: bytes,
                                                                                reason: str) -> None:
    refused = await node.ask(subjects.agent_starts, payload)

    assert isinstance(refused, CommandError) and refused.code == "invalid-request" and reason in refused.message
    await asyncio.sleep(0.3)
    assert node.nothing_started()


async def test_starts_signed_by_another_service_are_refused_whole(node: Node) -> None:
    payload = starts_request(start_request("pass"))
    headers = MONITOR.headers(subjects.agent_starts(node.name), payload, time.time())

    refused = await node.ask(subjects.agent_starts, payload, headers)

    assert isinstance(refused, CommandError) and refused.code in ("unauthenticated", "forbidden"), refused
    await asyncio.sleep(0.3)
    assert node.nothing_started()


async def test_a_command_that_ends_at_once_has_its_start_reported_with_its_exit(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "START_REPORT_SECONDS", 30.0)  # "at once", however busy the machine is
    assert await node.ask(subjects.agent_start, encode(start_request("pass"))) == ProcessAccepted(already_known=False)

    exited = await node.report(ProcessExited)

    assert isinstance(exited, ProcessExited) and exited.exit_code == 0
    assert exited.started is not None and exited.started.pid > 0  # one report: the launcher records both at once
    assert exited.started.started_at is not None and exited.exited_at is not None
    assert exited.started.started_at <= exited.exited_at
    assert not [r for r in node.reports if isinstance(r, ProcessStarted)]


async def test_a_parameter_server_has_its_start_reported_at_once_however_soon_it_ends(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher stops a task's parameter servers once its workers end, and starts the next task after:
    # it must know a server runs before the workers' exits (each with its start) can come.
    monkeypatch.setattr(agent_module, "START_REPORT_SECONDS", 30.0)
    request = start_request("import time; time.sleep(0.3)")
    request = msgspec.structs.replace(request, launch=msgspec.structs.replace(request.launch, role="ps"))
    assert await node.ask(subjects.agent_start, encode(request)) == ProcessAccepted(already_known=False)

    exited = await node.report(ProcessExited)

    assert isinstance(exited, ProcessExited) and exited.started is None
    assert len(node.starts()) == 1 and isinstance(node.starts()[0], ProcessStarted)


async def test_a_command_that_runs_on_has_its_start_reported_before_it_ends(node: Node) -> None:
    assert await node.ask(subjects.agent_start, encode(start_request(SLEEPER))) == ProcessAccepted(already_known=False)
    started = await node.report(ProcessStarted)
    assert started in node.reports  # on its own, while the command runs

    assert await node.ask(subjects.agent_stop, encode(StopProcesses(job_id=JOB, attempt=1, grace_seconds=1))) \
        == Stopped(stopped=1)
    exited = await node.report(ProcessExited)
    assert isinstance(exited, ProcessExited) and exited.started is None  # reported already
    assert node.starts() == [started]


async def test_a_malformed_stop_is_refused_and_leaves_the_job_running(node: Node) -> None:
    assert await node.ask(subjects.agent_start, encode(start_request(SLEEPER))) == ProcessAccepted(already_known=False)
    await node.report(ProcessStarted)
    stop = StopProcesses(job_id=JOB, attempt=1, grace_seconds=1)

    refused = await node.ask(subjects.agent_stop, changed(stop, lambda raw: raw.update(grace_seconds="soon")))

    assert isinstance(refused, CommandError), refused
    assert refused.code == "invalid-request"
    assert "grace_seconds: Expected `float`" in refused.message
    assert [e.field for e in refused.errors] == ["grace_seconds"]
    assert not node.agent.ranks.stopped_attempts
    await asyncio.sleep(0.3)
    assert not [r for r in node.reports if isinstance(r, ProcessExited)]

    assert await node.ask(subjects.agent_stop, encode(stop)) == Stopped(stopped=1)
    exited = await node.report(ProcessExited)
    assert isinstance(exited, ProcessExited) and exited.exit_code == 143  # SIGTERM


async def test_a_malformed_exec_is_refused_and_runs_nothing(node: Node) -> None:
    assert await node.ask(subjects.agent_start, encode(start_request(SLEEPER))) == ProcessAccepted(already_known=False)
    await node.report(ProcessStarted)
    exits: asyncio.Queue[ExecExited] = asyncio.Queue()

    async def exited(msg: Msg) -> None:
        exits.put_nowait(decode(msg.data, ExecExited))

    inbox = f"{job_inbox(JOB)}.exit-1"  # the job's own inbox: the only place the agent answers an exit
    subscription = await node.nc.subscribe(inbox, cb=exited)
    good = ExecInJob(job_id=JOB, attempt=1, command="exit 4", reply_to=inbox)

    elsewhere = await node.ask(subjects.agent_exec, encode(msgspec.structs.replace(good, reply_to="_INBOX.user-bob.x")),
                               AS_THE_JOB)
    assert isinstance(elsewhere, CommandError) and "reply_to must be under" in elsewhere.message

    refused = await node.ask(subjects.agent_exec, changed(good, lambda raw: raw.pop("reply_to")), AS_THE_JOB)

    assert isinstance(refused, CommandError), refused
    assert refused.code == "invalid-request"
    assert "reply_to: is required" in refused.message
    running = next(iter(node.agent.ranks.nodes.values()))
    assert running.execs == []
    await asyncio.sleep(0.3)
    assert exits.empty()

    assert await node.ask(subjects.agent_exec, encode(good), AS_THE_JOB) == ProcessAccepted(already_known=False)
    async with asyncio.timeout(WAIT_SECONDS):
        assert await exits.get() == ExecExited(exit_code=4)
    await subscription.unsubscribe()


async def test_a_request_whose_handling_fails_is_answered_internal(node: Node,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_probe() -> None:
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(node.agent.presence, "_probe", broken_probe)

    failed = await node.ask(subjects.agent_precheck, encode(PrecheckNode(job_id=JOB, cpus=1, memory_mib=1)))

    assert isinstance(failed, CommandError)
    assert failed.code == "internal"
    assert "the probe broke" in failed.message and node.name in failed.message
    # The agent goes on answering.
    assert await node.ask(subjects.agent_start, encode(start_request("pass"))) == ProcessAccepted(already_known=False)


def launcher_of_another_platform() -> ControlSigner:
    return ControlSigner.of("another-platform-secret-" * 2, "launcher")


FORGED_STARTS = {
    "unsigned": (lambda payload, node: {}, "not signed"),
    "signed by the monitor": (lambda payload, node: MONITOR.headers(subjects.agent_start(node), payload,
                                                                    time.time()), "only the launcher"),
    "signed with another key": (lambda payload, node: launcher_of_another_platform().headers(
        subjects.agent_start(node), payload, time.time()), "does not verify"),
    "signed for another node": (lambda payload, node: LAUNCHER.headers(subjects.agent_start("node-b"), payload,
                                                                       time.time()), "does not verify"),
    "signed ten minutes ago": (lambda payload, node: LAUNCHER.headers(subjects.agent_start(node), payload,
                                                                      time.time() - 600), "clock"),
}


@pytest.mark.parametrize("sign, reason", FORGED_STARTS.values(), ids=FORGED_STARTS.keys())
async def test_a_start_not_signed_by_the_launcher_is_refused_and_starts_nothing(
        node: Node, sign: Callable[[bytes, str], dict[str, str]], reason: str) -> None:
    payload = encode(start_request("open('pwned', 'w')"))

    refused = await node.ask(subjects.agent_start, payload, sign(payload, node.name))

    assert isinstance(refused, CommandError), refused
    assert refused.code == "unauthenticated" and reason in refused.message
    await asyncio.sleep(0.3)
    assert node.nothing_started()


async def test_a_signed_request_replayed_or_altered_is_refused(node: Node) -> None:
    payload = encode(start_request(SLEEPER))
    headers = signed(subjects.agent_start, node.name, payload)
    assert await node.ask(subjects.agent_start, payload, headers) == ProcessAccepted(already_known=False)
    await node.report(ProcessStarted)
    stop = encode(StopProcesses(job_id=JOB, attempt=1, grace_seconds=1))
    stop_headers = signed(subjects.agent_stop, node.name, stop)
    longer = encode(StopProcesses(job_id=JOB, attempt=1, grace_seconds=0))

    altered = await node.ask(subjects.agent_stop, longer, stop_headers)
    replayed = await node.ask(subjects.agent_start, payload, headers)

    assert isinstance(altered, CommandError) and "does not verify" in altered.message
    assert isinstance(replayed, CommandError) and "replay" in replayed.message
    assert not node.agent.ranks.stopped_attempts
    assert await node.ask(subjects.agent_stop, stop, stop_headers) == Stopped(stopped=1)


async def _runs_ended(node: Node) -> None:
    """Wait until the agent is done with every rank it ran: reported, and its folder removed."""
    runners = [n.runner for n in node.agent.ranks.nodes.values() if n.runner is not None]
    async with asyncio.timeout(WAIT_SECONDS):
        await asyncio.gather(*runners)


RESTARTS = {
    "with its folder": (False, "already received once: a replay is refused"),
    "with its folder wiped": (True, "signed before this agent started"),
}


@pytest.mark.parametrize("wiped, reason", RESTARTS.values(), ids=RESTARTS.keys())
async def test_a_start_obeyed_before_the_agent_restarted_is_refused_after_and_a_new_one_runs(
        node: Node, tmp_path: Path, wiped: bool, reason: str) -> None:
    runs = tmp_path / "runs"
    payload = encode(start_request(f"open({str(runs)!r}, 'a').write('ran\\n')"))
    captured = signed(subjects.agent_start, node.name, payload)  # the launcher's start, as seen on the wire
    assert await node.ask(subjects.agent_start, payload, captured) == ProcessAccepted(already_known=False)
    await node.report(ProcessExited)
    await _runs_ended(node)  # nothing left for the next agent to adopt: the job is over
    await node.restart(wiped=wiped)

    replayed = await node.ask(subjects.agent_start, payload, captured)

    assert isinstance(replayed, CommandError) and replayed.code == "unauthenticated", replayed
    assert reason in replayed.message
    assert not node.agent.ranks.nodes
    # The launcher's own retries are signed anew, and run.
    assert await node.ask(subjects.agent_start, payload) == ProcessAccepted(already_known=False)
    await _runs_ended(node)
    assert runs.read_text() == "ran\n" * 2


async def test_the_node_chooses_ports_nothing_holds_and_answers_the_same_for_the_same_attempt(node: Node) -> None:
    request = encode(ReservePorts(job_id=JOB, attempt=1, count=2))
    chosen = await node.ask(subjects.agent_ports, request)
    assert isinstance(chosen, PortsReserved) and len(set(chosen.ports)) == 2, chosen
    for port in chosen.ports:
        with socket.socket() as job:  # free for the job to listen on
            job.bind(("0.0.0.0", port))
    assert await node.ask(subjects.agent_ports, request) == chosen
    other = await node.ask(subjects.agent_ports, encode(ReservePorts(job_id=JOB, attempt=2, count=1)))
    assert isinstance(other, PortsReserved) and not set(other.ports) & set(chosen.ports)


async def test_ports_asked_by_anyone_but_the_launcher_are_refused(node: Node) -> None:
    request = encode(ReservePorts(job_id=JOB, attempt=1, count=1))
    refused = await node.ask(subjects.agent_ports, request, MONITOR.headers(subjects.agent_ports(node.name), request,
                                                                            time.time()))
    assert isinstance(refused, CommandError) and refused.code == "unauthenticated", refused
    assert node.agent.ports.reservations == {}


async def test_an_exec_without_the_attempts_token_runs_nothing(node: Node) -> None:
    assert await node.ask(subjects.agent_start, encode(start_request(SLEEPER))) == ProcessAccepted(already_known=False)
    await node.report(ProcessStarted)
    exec_ = encode(ExecInJob(job_id=JOB, attempt=1, command="touch pwned", reply_to=f"{job_inbox(JOB)}.x"))

    anonymous = await node.ask(subjects.agent_exec, exec_, {})
    another_job = await node.ask(subjects.agent_exec, exec_, bearer_headers("the-token-of-another-job"))
    the_launcher = await node.ask(subjects.agent_exec, exec_, signed(subjects.agent_start, node.name, exec_))

    for refused in (anonymous, another_job, the_launcher):
        assert isinstance(refused, CommandError), refused
        assert refused.code == "unauthenticated"
    assert "does not carry the token of job" in another_job.message
    running = next(iter(node.agent.ranks.nodes.values()))
    assert running.execs == []
