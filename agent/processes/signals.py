"""Stopping the processes of a job attempt on this node (SPEC M3, J12).

A node's command runs as a process group, but killpg on it is not enough: torch's elastic launcher
(torchrun, torch.distributed.launch) starts its workers in sessions of their own. Every process the
agent starts carries the attempt in its environment (TRAINYARD_JOB_ID, TRAINYARD_ATTEMPT,
TRAINYARD_TASK, TRAINYARD_NODE) and children inherit it, so the attempt's processes are those whose
environment names it, plus the members of its process groups.

A checkpoint signal (SIGUSR1) goes only to the processes that catch it: the launchers around the
workers do not, and the signal's default action would kill them before the workers have saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PROC = Path("/proc")
POLL_SECONDS = 0.1
# Set on the processes of a debug session: they run in the job's environment but are not the job.
SESSION_VARIABLE = "TRAINYARD_SESSION"


class Leader(Protocol):
    """The leader of a process group the agent stops: a node's held command, or an exec."""

    @property
    def pid(self) -> int: ...

    @property
    def running(self) -> bool: ...

    def signal(self, sig: signal.Signals) -> None: ...

    async def wait(self) -> int: ...


@dataclass(frozen=True)
class Attempt:
    """The processes of one job attempt on one node (one task of it, or all)."""

    job_id: str
    attempt: int
    node: str
    task: int | None = None

    def owns(self, env: Mapping[str, str]) -> bool:
        return (env.get("TRAINYARD_JOB_ID") == self.job_id and env.get("TRAINYARD_ATTEMPT") == str(self.attempt)
                # Several agents may share a host (the local stack): each stops its own node only.
                and env.get("TRAINYARD_NODE") == self.node
                and (self.task is None or env.get("TRAINYARD_TASK") == str(self.task))
                and SESSION_VARIABLE not in env)


def parse_signal(name: str) -> signal.Signals:
    """`SIGUSR1`, `USR1` or `10`; ValueError for anything else."""
    text = name.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ValueError(f"{name!r} is not a signal name such as SIGUSR1") from None


def _state_and_group(pid_dir: Path) -> tuple[str, int] | None:
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return fields[0], int(fields[2])
    except (IndexError, ValueError):
        return None


def _trainyard_environment(pid_dir: Path) -> dict[str, str] | None:
    try:
        raw = (pid_dir / "environ").read_bytes()
    except OSError:  # another user's process, or gone
        return None
    env = {}
    for item in raw.split(b"\0"):
        if item.startswith(b"TRAINYARD_"):
            key, _, value = item.partition(b"=")
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def attempt_processes(attempt: Attempt, groups: Collection[int] = (), *, proc: Path = PROC) -> set[int]:
    """The live processes of `attempt`: tagged with it, or members of one of the process `groups`."""
    return tagged_processes(attempt.owns, groups, proc=proc)


def session_processes(node: str, *, proc: Path = PROC) -> set[int]:
    """The live processes of this node's debug sessions."""
    return tagged_processes(lambda env: SESSION_VARIABLE in env and env.get("TRAINYARD_NODE") == node, proc=proc)


def tagged_processes(owns: Callable[[Mapping[str, str]], bool], groups: Collection[int] = (), *,
                     proc: Path = PROC) -> set[int]:
    """The live processes whose TRAINYARD_* variables `owns` accepts, or in one of the process `groups`."""
    found: set[int] = set()
    me = os.getpid()
    try:
        entries = list(proc.iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        stat = _state_and_group(entry)
        if stat is None or stat[0] in ("Z", "X"):  # gone, or dead and only waiting to be reaped
            continue
        if stat[1] in groups:
            found.add(int(entry.name))
            continue
        env = _trainyard_environment(entry)
        if env is not None and owns(env):
            found.add(int(entry.name))
    return found


def catches(pid: int, signum: int, *, proc: Path = PROC) -> bool:
    """Whether the process has a handler for the signal (its bit in SigCgt of /proc/<pid>/status)."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def send(pids: Collection[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


async def _wait_until_gone(attempt: Attempt, groups: Collection[int], seconds: float, proc: Path) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while await asyncio.to_thread(attempt_processes, attempt, groups, proc=proc):
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(POLL_SECONDS)


async def stop_attempt(attempt: Attempt, groups: Sequence[Leader], grace_seconds: float,
                       checkpoint_signal: signal.Signals | None = None, *, proc: Path = PROC) -> list[int]:
    """Stop the attempt's processes on this node; returns those the checkpoint signal was sent to.

    With a checkpoint signal that some process catches: signal those, wait up to the grace for every
    process of the attempt to be gone, then SIGKILL what is left. Otherwise: SIGTERM the groups, wait
    up to the grace for their leaders, then SIGKILL the groups and every process tagged with the attempt.
    An attempt whose groups have all ended only has its leftovers killed, at once.
    """
    live = [g for g in groups if g.running]
    leaders = {g.pid for g in live}
    signalled: list[int] = []
    if live and checkpoint_signal is not None:
        members = await asyncio.to_thread(attempt_processes, attempt, leaders, proc=proc)
        signalled = sorted(pid for pid in members if catches(pid, checkpoint_signal, proc=proc))
    if signalled and checkpoint_signal is not None:
        send(signalled, checkpoint_signal)
        await _wait_until_gone(attempt, leaders, grace_seconds, proc)
    elif live:
        for group in live:
            group.signal(signal.SIGTERM)
        await asyncio.wait([asyncio.ensure_future(g.wait()) for g in live], timeout=grace_seconds)
    for group in live:
        group.signal(signal.SIGKILL)
    send(await asyncio.to_thread(attempt_processes, attempt, leaders, proc=proc), signal.SIGKILL)
    return signalled
