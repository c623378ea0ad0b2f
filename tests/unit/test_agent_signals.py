"""Stopping a job attempt with its checkpoint signal (SPEC J12, M3), on real processes.

torch's elastic launcher starts its workers in sessions of their own, out of reach of a signal to
the node's process group; these tests build that layout (and its reverse) from plain Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from agent.processes.signals import Attempt, attempt_processes, catches, parse_signal, send, stop_attempt
from agent.ranks.process import ProcessGroup

pytestmark = pytest.mark.asyncio(loop_scope="session")

NODE = "node-sig"
GRACE_SECONDS = 1.0

def catcher(role: str, saved: Path) -> str:
    """A process that handles SIGUSR1 by saving (writing `saved`) and leaving."""
    return f"""
import os, signal, sys, time
def save(signum, frame):
    with open({str(saved)!r}, "w") as f:
        f.write("saved\\n")
    sys.exit(0)
signal.signal(signal.SIGUSR1, save)
print("{role}", os.getpid(), flush=True)
time.sleep(600)
"""


def bystander(role: str, *, ignore_sigterm: bool = False) -> str:
    """A process that catches nothing (and may shrug off SIGTERM)."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_sigterm else ""
    return f"""
import os, signal, time
{ignore}
print("{role}", os.getpid(), flush=True)
time.sleep(600)
"""


def launcher(worker: str, own: str) -> list[str]:
    """Start `worker` in a new session, as torchrun starts its workers, then run `own`."""
    return ["import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True); "
            "exec(sys.argv[2])", worker, own]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"  # a zombie has ended


async def all_gone(attempt: Attempt, *pids: int) -> bool:
    """Whether the attempt's processes (and `pids`) end; a killed process takes a moment to be gone."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while attempt_processes(attempt) or any(alive(pid) for pid in pids):
                await asyncio.sleep(0.05)
    return not attempt_processes(attempt) and not any(alive(pid) for pid in pids)


class Running:
    """A node's process group as the agent runs it, with the output it printed so far."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.lines: list[str] = []
        self.exit: asyncio.Task[int] = asyncio.create_task(group.pump(self._collect))

    async def _collect(self, line: str) -> None:
        self.lines.append(line)

    async def pids(self, *roles: str) -> dict[str, int]:
        """Wait until every role announced itself (its signal handlers are set by then)."""
        async with asyncio.timeout(30):
            while True:
                found = {line.split()[0]: int(line.split()[1]) for line in self.lines if len(line.split()) == 2}
                if all(role in found for role in roles):
                    return found
                await asyncio.sleep(0.05)


@pytest_asyncio.fixture(loop_scope="session")
async def attempt() -> AsyncIterator[Attempt]:
    found = Attempt(job_id=f"job-{uuid.uuid4().hex[:12]}", attempt=1, node=NODE)
    yield found
    send(attempt_processes(found), signal.SIGKILL)  # nothing a failed test started outlives it


async def start(attempt: Attempt, tmp_path: Path, *argv: str, node: str = NODE) -> Running:
    env = {**os.environ, "TRAINYARD_JOB_ID": attempt.job_id, "TRAINYARD_ATTEMPT": str(attempt.attempt),
           "TRAINYARD_TASK": "0", "TRAINYARD_RANK": "0", "TRAINYARD_NODE": node}
    group = ProcessGroup([sys.executable, "-c", *argv], env, tmp_path, tmp_path / f"output-{uuid.uuid4().hex}.log")
    await group.start()
    return Running(group)


async def test_the_catching_leader_saves_and_its_worker_in_another_session_is_killed(
        attempt: Attempt, tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    running = await start(attempt, tmp_path, *launcher(bystander("worker"), catcher("leader", saved)))
    pids = await running.pids("leader", "worker")

    signalled = await stop_attempt(attempt, [running.group], GRACE_SECONDS, signal.SIGUSR1)

    assert signalled == [pids["leader"]]
    assert saved.read_text() == "saved\n"
    assert await running.exit == 0  # it left on its own after saving
    assert await all_gone(attempt, pids["worker"])


async def test_workers_in_their_own_session_save_while_the_launcher_is_spared(
        attempt: Attempt, tmp_path: Path) -> None:
    # torchrun's layout: the node's command is a launcher that does not catch SIGUSR1 (it would die
    # of it), its worker in a new session does.
    saved = tmp_path / "saved"
    running = await start(attempt, tmp_path, *launcher(catcher("worker", saved), bystander("leader")))
    pids = await running.pids("leader", "worker")
    assert catches(pids["worker"], signal.SIGUSR1) and not catches(pids["leader"], signal.SIGUSR1)

    signalled = await stop_attempt(attempt, [running.group], GRACE_SECONDS, signal.SIGUSR1)

    assert signalled == [pids["worker"]]
    assert saved.read_text() == "saved\n"
    assert await running.exit == 128 + signal.SIGKILL  # the launcher got no SIGUSR1, only the final kill
    assert await all_gone(attempt, pids["worker"])


async def test_without_a_catcher_a_checkpoint_stop_is_a_plain_stop(attempt: Attempt, tmp_path: Path) -> None:
    running = await start(attempt, tmp_path, bystander("leader"))
    await running.pids("leader")

    assert await stop_attempt(attempt, [running.group], GRACE_SECONDS, signal.SIGUSR1) == []

    assert await running.exit == 128 + signal.SIGTERM


async def test_a_process_ignoring_sigterm_is_killed_after_the_grace_with_its_worker(
        attempt: Attempt, tmp_path: Path) -> None:
    running = await start(attempt, tmp_path, *launcher(bystander("worker", ignore_sigterm=True),
                                                       bystander("leader", ignore_sigterm=True)))
    pids = await running.pids("leader", "worker")

    await stop_attempt(attempt, [running.group], GRACE_SECONDS)

    assert await running.exit == 128 + signal.SIGKILL
    assert await all_gone(attempt, pids["worker"])  # outside the group, found by its environment


async def test_a_stop_leaves_the_same_job_on_another_node_of_the_host_alone(
        attempt: Attempt, tmp_path: Path) -> None:
    mine = await start(attempt, tmp_path, bystander("leader"))
    other = await start(attempt, tmp_path, bystander("leader"), node="node-other")
    await mine.pids("leader")
    theirs = (await other.pids("leader"))["leader"]

    await stop_attempt(attempt, [mine.group], GRACE_SECONDS)

    assert await mine.exit == 128 + signal.SIGTERM
    assert alive(theirs)
    other.group.signal(signal.SIGKILL)
    await other.exit


async def test_a_stop_of_an_ended_attempt_only_kills_its_leftovers(attempt: Attempt, tmp_path: Path) -> None:
    running = await start(attempt, tmp_path, *launcher(bystander("worker"), "print('leaving', flush=True)"))
    leftover = (await running.pids("worker"))["worker"]
    await running.group.wait()  # the launcher left; its worker stays, in a session of its own

    assert await stop_attempt(attempt, [running.group], 600.0, signal.SIGUSR1) == []

    assert await running.exit == 0  # the output the worker held open is closed: the node's exit is known
    assert await all_gone(attempt, leftover)


async def test_signal_names() -> None:
    assert parse_signal("SIGUSR1") == parse_signal("usr1") == parse_signal("10") == signal.SIGUSR1
    with pytest.raises(ValueError, match="SIGNOPE"):
        parse_signal("SIGNOPE")
