"""Every request to a node agent gets an answer: a malformed start, stop or exec is refused with the
reason instead of being dropped, and changes nothing. Against a real agent on real NATS; the
monitor's side (registration) is a stub.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.workspace import BACKEND_VARIABLE, PLAIN
from libs.contracts import subjects
from libs.contracts.agent import (
    ExecExited,
    ExecInJob,
    PrecheckNode,
    ProcessAccepted,
    ProcessExited,
    ProcessStarted,
    StartProcess,
    Stopped,
    StopProcesses,
)
from libs.contracts.codec import decode, decode_any, encode
from libs.contracts.events import NodeLaunch
from libs.contracts.messages import CommandError
from libs.natsroles import job_inbox
from tests.support.agents import WAIT_SECONDS, Node, registered_node

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-5e5510aa0002"
SLEEPER = "import time; time.sleep(600)"


@pytest_asyncio.fixture(loop_scope="session")
async def node(nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    monkeypatch.setenv(BACKEND_VARIABLE, PLAIN)

    async with registered_node(nc, nats_url, tmp_path, job_id=JOB, health_probe_seconds=60) as found:
        yield found


def start_request(code: str, attempt: int = 1) -> StartProcess:
    return StartProcess(job_id=JOB, attempt=attempt, launch=NodeLaunch(
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
    assert len([r for r in node.reports if isinstance(r, ProcessStarted)]) == 1


async def test_a_malformed_stop_is_refused_and_leaves_the_job_running(node: Node) -> None:
    assert await node.ask(subjects.agent_start, encode(start_request(SLEEPER))) == ProcessAccepted(already_known=False)
    await node.report(ProcessStarted)
    stop = StopProcesses(job_id=JOB, attempt=1, grace_seconds=1)

    refused = await node.ask(subjects.agent_stop, changed(stop, lambda raw: raw.update(grace_seconds="soon")))

    assert isinstance(refused, CommandError), refused
    assert refused.code == "invalid-request"
    assert "grace_seconds: Expected `float`" in refused.message
    assert [e.field for e in refused.errors] == ["grace_seconds"]
    assert not node.agent.stopped_attempts
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

    elsewhere = await node.ask(subjects.agent_exec, encode(msgspec.structs.replace(good, reply_to="_INBOX.user-bob.x")))
    assert isinstance(elsewhere, CommandError) and "reply_to must be under" in elsewhere.message

    refused = await node.ask(subjects.agent_exec, changed(good, lambda raw: raw.pop("reply_to")))

    assert isinstance(refused, CommandError), refused
    assert refused.code == "invalid-request"
    assert "reply_to: is required" in refused.message
    running = next(iter(node.agent.nodes.values()))
    assert running.execs == []
    await asyncio.sleep(0.3)
    assert exits.empty()

    assert await node.ask(subjects.agent_exec, encode(good)) == ProcessAccepted(already_known=False)
    async with asyncio.timeout(WAIT_SECONDS):
        assert await exits.get() == ExecExited(exit_code=4)
    await subscription.unsubscribe()


async def test_a_request_whose_handling_fails_is_answered_internal(node: Node,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_probe() -> None:
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(node.agent, "_probe", broken_probe)

    reply = await node.nc.request(subjects.agent_precheck(node.name),
                                  encode(PrecheckNode(job_id=JOB, cpus=1, memory_mib=1)), timeout=10)

    failed = decode_any(reply.data, CommandError)
    assert failed.code == "internal"
    assert "the probe broke" in failed.message and node.name in failed.message
    # The agent goes on answering.
    assert await node.ask(subjects.agent_start, encode(start_request("pass"))) == ProcessAccepted(already_known=False)
