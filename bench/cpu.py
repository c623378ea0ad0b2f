"""Where a workload's CPU goes: each process's CPU seconds between two looks at /proc, grouped by role.

Only the run's own processes are counted: those this process started (and theirs), and those whose command
line names the run's folder (servers that detach, such as PostgreSQL's) with theirs, so that other work on
the machine does not count. A process that ended between the looks is counted in its parent's children's
time once reaped (a job's sandbox and command in its agent's holder server); one that ended without being
reaped by a process we look at is not counted, which the machine's busy time beside the sum shows. The kernel's
own threads (work queues, soft interrupts) are shown beside it, all of them: they work for every process alike.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
# The role of a process, by its command line; the first that matches.
ROLES = (
    (re.compile(r"-m services\.scheduler"), "scheduler"),
    (re.compile(r"-m services\.launcher"), "launcher"),
    (re.compile(r"-m services\.monitor"), "monitor"),
    (re.compile(r"-m services\.autoscaler"), "autoscaler"),
    (re.compile(r"-m services\.gateway"), "gateway"),
    (re.compile(r"holder\.py --serve"), "holder servers"),
    (re.compile(r"-m agent\b"), "agents"),
    (re.compile(r"nats-server"), "nats-server"),
    (re.compile(r"postgres"), "postgres"),
    (re.compile(r"-m bench\."), "benchmark client"),
    (re.compile(r"slurm|munged|sbatch|squeue"), "slurm"),
)
# What the processes of a role reaped, when it ended within a look and another: the processes they started.
REAPED = {"holder servers": "jobs (sandboxes, commands)", "benchmark client": "benchmark's commands (sbatch...)",
          "slurm": "slurm's children (slurmstepd, jobs)"}


@dataclass(frozen=True)
class Look:
    # pid -> (role, own seconds, reaped children's seconds, and of each the seconds in the kernel)
    processes: dict[int, tuple[str, float, float, float, float]]
    busy: float  # the machine's busy CPU seconds since boot
    total: float  # all its CPU seconds since boot, idle included
    kernel_threads: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds, of the kernel's threads


def role_of(command: str) -> str:
    for pattern, role in ROLES:
        if pattern.search(command):
            return role
    return "other"


def look(*folders: Path) -> Look:
    """The CPU of this run's processes: this one's descendants, and those whose command line names one of its
    `folders`, with their descendants."""
    found: dict[int, tuple[int, str, float, float, float, float]] = {}  # pid -> (parent, command, times...)
    kernel_threads: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        own = (int(fields[11]) + int(fields[12])) / TICKS
        if entry.name == "2" or fields[1] == "2":  # kthreadd, and the threads it made
            kernel_threads[int(entry.name)] = own
            continue
        children = (int(fields[13]) + int(fields[14])) / TICKS
        found[int(entry.name)] = (int(fields[1]), command, own, children, int(fields[12]) / TICKS,
                                  int(fields[14]) / TICKS)
    roots = {os.getpid()} | {pid for pid, (_, command, *_) in found.items()
                             if any(str(folder) in command for folder in folders)}

    def ours(pid: int) -> bool:
        for _ in range(64):  # up the chain of parents
            if pid in roots:
                return True
            if pid not in found or pid <= 1:
                return False
            pid = found[pid][0]
        return False

    processes = {pid: (role_of(command), own, children, own_system, children_system)
                 for pid, (_, command, own, children, own_system, children_system) in found.items() if ours(pid)}
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return Look(processes, (sum(values) - idle) / TICKS, sum(values) / TICKS, kernel_threads)


@dataclass(frozen=True)
class Spent:
    by_role: dict[str, float]  # CPU seconds
    system: dict[str, float]  # of which in the kernel
    busy: float  # the machine's busy CPU seconds between the looks
    total: float
    kernel_threads: float = 0.0  # the kernel's threads' CPU seconds between the looks (but of those that ended)


def spent(before: Look, after: Look) -> Spent:
    by_role: dict[str, float] = {}
    system: dict[str, float] = {}
    for pid, (role, own, children, own_system, children_system) in after.processes.items():
        was = before.processes.get(pid, (role, 0.0, 0.0, 0.0, 0.0))
        reaped = REAPED.get(role, f"{role}: what it reaped")
        for name, seconds, kernel, was_seconds, was_kernel in ((role, own, own_system, was[1], was[3]),
                                                               (reaped, children, children_system, was[2], was[4])):
            by_role[name] = by_role.get(name, 0.0) + seconds - was_seconds
            system[name] = system.get(name, 0.0) + kernel - was_kernel
    ranked = sorted(by_role.items(), key=lambda item: -item[1])
    return Spent({role: seconds for role, seconds in ranked if seconds > 0.005}, system,
                 after.busy - before.busy, after.total - before.total,
                 sum(seconds - before.kernel_threads.get(pid, 0.0) for pid, seconds in after.kernel_threads.items()))


def table(spent: Spent, jobs: int) -> list[str]:
    """The CPU of each role in seconds and in milliseconds per job."""
    lines = [f"  {'CPU':<36} {'seconds':>8} {'ms/job':>7} {'in the kernel':>14}"]
    for role, seconds in spent.by_role.items():
        lines.append(f"  {role:<36} {seconds:>8.2f} {seconds / jobs * 1000:>7.2f}"
                     f" {spent.system.get(role, 0.0) / jobs * 1000:>14.2f}")
    counted = sum(spent.by_role.values())
    lines.append(f"  {'counted':<36} {counted:>8.2f} {counted / jobs * 1000:>7.2f}")
    lines.append(f"  {'kernel threads (the whole machine)':<36} {spent.kernel_threads:>8.2f}"
                 f" {spent.kernel_threads / jobs * 1000:>7.2f}")
    lines.append(f"  {'the machine busy':<36} {spent.busy:>8.2f} {spent.busy / jobs * 1000:>7.2f}"
                 f"   (of {spent.total:.1f} CPU seconds)")
    return lines
