"""Sampling a node's process group: its children count, busy CPUs show, memory is resident size."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from agent.usage import GroupSampler, ProcessTree

BUSY_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "buf = bytearray(64 * 2**20)\\nwhile True: pass"])
time.sleep(30)
"""


def test_the_sample_covers_the_children_and_sees_them_busy() -> None:
    leader = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        sampler = GroupSampler(leader.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.5)
            cpu, memory_mib, processes = sampler.sample()
            if processes == 2 and cpu > 50 and memory_mib >= 64:
                break
        assert processes == 2
        assert cpu > 50  # the child spins on a CPU
        assert memory_mib >= 64  # and holds its 64 MiB buffer
    finally:
        for child in psutil.Process(leader.pid).children(recursive=True):
            child.kill()
        leader.kill()
        leader.wait()


def test_the_first_sample_measures_the_cpu_since_each_process_started() -> None:
    spin_then_sleep = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\ntime.sleep(30)"
    leader = subprocess.Popen([sys.executable, "-c", spin_then_sleep])
    try:
        time.sleep(1.0)  # busy all along so far
        cpu, _, processes = GroupSampler(leader.pid).sample()
        assert processes == 1 and cpu > 30  # not the 0 a first measurement of an interval would give
    finally:
        leader.kill()
        leader.wait()


def test_a_finished_group_samples_as_nothing() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert GroupSampler(done.pid).sample() == (0.0, 0, 0)


def test_ranks_sampled_together_share_one_look_at_the_host_processes() -> None:
    tree = ProcessTree(max_age=60.0)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert GroupSampler(first.pid, tree).sample()[2] == 1
        parent = psutil.Process().pid
        assert first.pid in tree.descendants(parent)
        second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert second.pid not in tree.descendants(parent)  # started after the look, which still serves
            assert second.pid in ProcessTree(max_age=0.0).descendants(parent)
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()
