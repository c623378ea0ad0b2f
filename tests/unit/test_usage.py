"""Sampling a node's process group: its children count, busy CPUs show, memory is resident size."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from agent.output.usage import GroupSampler, ProcessTree

BUSY_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "buf = bytearray(64 * 2**20)\\nwhile True: pass"])
time.sleep(30)
"""


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def test_the_sample_covers_the_children_and_sees_them_busy() -> None:
    """However little CPU a loaded machine gives the spinning child, the sample counts at least what it used."""
    leader = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        sampler = GroupSampler(leader.pid)
        deadline = time.monotonic() + 60
        while True:
            # The child's CPU time read between two samples: the second sample's interval holds that one.
            began = time.monotonic()
            _, _, before = sampler.sample()
            children = psutil.Process(leader.pid).children()
            spun = cpu_seconds(children[0]) if children else 0.0
            time.sleep(0.5)
            spun = cpu_seconds(children[0]) - spun if children else 0.0
            cpu, memory_mib, processes = sampler.sample()
            ended = time.monotonic()
            if (before == processes == 2 and spun > 0 and memory_mib >= 64) or time.monotonic() > deadline:
                break
        assert processes == 2
        assert cpu >= 100 * spun / (ended - began) > 0  # the child's spinning is in it
        assert memory_mib >= 64  # and its 64 MiB buffer
    finally:
        for child in psutil.Process(leader.pid).children(recursive=True):
            child.kill()
        leader.kill()
        leader.wait()


def test_the_first_sample_measures_the_cpu_since_each_process_started() -> None:
    spin_then_sleep = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\ntime.sleep(30)"
    leader = subprocess.Popen([sys.executable, "-c", spin_then_sleep])
    try:
        process = psutil.Process(leader.pid)
        deadline = time.monotonic() + 60
        while (used := cpu_seconds(process)) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # busy all along so far, however little CPU it got
        cpu, _, processes = GroupSampler(leader.pid).sample()
        lived = time.time() - process.create_time()
        # At least what it had used by then, over at most how long it had lived: not the 0 a first measurement
        # of an interval would give.
        assert processes == 1 and cpu >= 100 * used / lived > 0
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
