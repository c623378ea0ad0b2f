"""Resource usage of one node's process group (SPEC L9): CPU, memory and, where reported, boards."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

from libs.contracts.agent import UsageSample


class ProcessTree:
    """Which process started which, read from /proc at most every `max_age` seconds however many ranks sample:
    a look costs a read of every process on the host, and an agent with many ranks sampled each of them."""

    def __init__(self, max_age: float = 0.5) -> None:
        self.max_age = max_age
        self._children: dict[int, list[int]] = {}
        self._read_at = -max_age
        self._lock = threading.Lock()  # samples are taken in worker threads

    def descendants(self, pid: int) -> list[int]:
        """The processes under `pid`, as of a look at most `max_age` old (one started since may be missing)."""
        with self._lock:
            if time.monotonic() - self._read_at >= self.max_age:
                self._children, self._read_at = _children_of_all(), time.monotonic()
            children = self._children
        found, waiting = [], list(children.get(pid, ()))
        while waiting:
            child = waiting.pop()
            found.append(child)
            waiting.extend(children.get(child, ()))
        return found


def _children_of_all() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split(maxsplit=2)[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(parent, []).append(int(entry.name))
    return children


@dataclass
class GroupSampler:
    """Samples a process and all its descendants; CPU is measured between consecutive samples. Ranks of one
    agent share a `tree`."""

    pid: int
    tree: ProcessTree = field(default_factory=lambda: ProcessTree(max_age=0.0))
    _known: dict[int, psutil.Process] = field(default_factory=dict)

    def sample(self) -> tuple[float, int, int]:
        """(CPU percent where 100 is one busy CPU, resident memory in MiB, process count)."""
        if not psutil.pid_exists(self.pid):
            return 0.0, 0, 0
        cpu, rss, alive = 0.0, 0, {}
        for pid in [self.pid, *self.tree.descendants(self.pid)]:
            # Reuse the Process object seen last time: its cpu_percent() measures since then. A process seen
            # for the first time is measured since it started.
            known = self._known.get(pid)
            process = known or _process(pid)
            if process is None:
                continue  # ended since the look
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                busy = process.cpu_percent(interval=None)
                if known is None:
                    times, ran = process.cpu_times(), time.time() - process.create_time()
                    busy = 100 * (times.user + times.system) / ran if ran > 0 else 0.0
                cpu += busy
                rss += process.memory_info().rss
                alive[pid] = process
        self._known = alive
        return cpu, rss // 2**20, len(alive)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def accelerator_percent() -> float | None:
    """Mean utilisation of the host's NVIDIA boards from nvidia-smi, or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=5, check=True)
        values = [float(v) for v in result.stdout.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return sum(values) / len(values) if values else None


def system_values(sample: UsageSample) -> dict[str, float]:
    """A usage sample as the run's system series of its rank (R1)."""
    values = {"cpu_percent": sample.cpu_percent, "memory_mib": float(sample.memory_mib),
              "processes": float(sample.processes)}
    if sample.accelerator_percent is not None:
        values["accelerator_percent"] = sample.accelerator_percent
    return values
