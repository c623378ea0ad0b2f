"""Resource usage of one node's process group (SPEC L9): CPU, memory and, where reported, boards."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from libs.contracts.agent import UsageSample


@dataclass
class GroupSampler:
    """Samples a process and all its descendants; CPU is measured between consecutive samples."""

    pid: int
    _known: dict[int, psutil.Process] = field(default_factory=dict)

    def sample(self) -> tuple[float, int, int]:
        """(CPU percent where 100 is one busy CPU, resident memory in MiB, process count)."""
        try:
            leader = psutil.Process(self.pid)
            members = [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0, 0, 0
        cpu, rss, alive = 0.0, 0, {}
        for member in members:
            # Reuse the Process object seen last time: its cpu_percent() measures since then. A process seen
            # for the first time is measured since it started.
            known = self._known.get(member.pid)
            process = known or member
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                busy = process.cpu_percent(interval=None)
                if known is None:
                    times, ran = process.cpu_times(), time.time() - process.create_time()
                    busy = 100 * (times.user + times.system) / ran if ran > 0 else 0.0
                cpu += busy
                rss += process.memory_info().rss
                alive[member.pid] = process
        self._known = alive
        return cpu, rss // 2**20, len(alive)


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
