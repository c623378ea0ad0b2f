"""The Slurm peer of the throughput and gang benchmarks (bench/slurm.py): the slurm.conf each of its settings
writes, and how it reads the jobcomp file, slurmctld's log and a wide job's output. Nothing here starts Slurm."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

import pytest

from bench.slurm import (
    LISTED,
    THROUGHPUT,
    Completion,
    Completions,
    Result,
    Settings,
    SlurmPeer,
    fastest,
    free_ports,
    in_flight_counts,
    parse_allocations,
    parse_completions,
    parse_launch,
)

RECORD = ("JobId={id} UserId=root(0) GroupId=root(0) Name={name} JobState={state} Partition=bench "
          "TimeLimit=UNLIMITED StartTime=2026-12-03T08:04:11 EndTime=2026-12-03T08:04:12 NodeList=node3 NodeCnt=1 "
          "ProcCnt=1 WorkDir=/tmp/peer/jobs ReservationName= Tres=cpu=1,mem=64M,node=1,billing=1 Account= QOS= "
          "WcKey= Cluster=unknown SubmitTime=2026-12-03T08:04:10 EligibleTime=2026-12-03T08:04:10 "
          "DerivedExitCode=0:0 ExitCode=0:0 \n")


def conf(settings: Settings, tmp_path: Path) -> dict[str, str]:
    peer = SlurmPeer(tmp_path, nodes=2, settings=settings)
    lines = peer._slurm_conf(20000, [20010, 20011]).splitlines()
    return dict(line.split("=", 1) for line in lines if not line.startswith(("NodeName", "PartitionName")))


def test_the_listed_settings_keep_ended_jobs_for_squeue_and_pack_memory(tmp_path: Path) -> None:
    written = conf(LISTED, tmp_path)
    assert written["MinJobAge"] == "3600"  # the start-estimates benchmark reads ended jobs back with squeue
    assert written["SelectTypeParameters"] == "CR_Core_Memory"
    assert written["AuthType"] == "auth/munge" and written["AuthInfo"].startswith("socket=")
    assert written["JobCompType"] == "jobcomp/none"
    assert written["SlurmctldPort"] == "20000"


def test_the_throughput_settings_forget_ended_jobs_and_count_them_from_the_jobcomp_file(tmp_path: Path) -> None:
    written = conf(THROUGHPUT, tmp_path)
    assert written["MinJobAge"] == str(THROUGHPUT.min_job_age) and THROUGHPUT.min_job_age <= 5
    assert written["SelectTypeParameters"] == "CR_Core"
    assert written["AuthType"] == f"auth/{THROUGHPUT.auth}" and written["CredType"] == f"cred/{THROUGHPUT.auth}"
    assert written["JobCompType"] == "jobcomp/filetxt" and written["JobCompLoc"] == str(tmp_path / "jobcomp.txt")
    ports = THROUGHPUT.controller_ports
    assert written["SlurmctldPort"] == (f"20000-{20000 + ports - 1}" if ports > 1 else "20000")
    assert written["SlurmctldDebug"] == written["SlurmdDebug"] == THROUGHPUT.debug
    for value in ("MinJobAge=", "SelectTypeParameters=CR_Core", "JobCompType=jobcomp/filetxt"):
        assert value in THROUGHPUT.describe()


def test_completions_are_counted_by_name_and_state_from_whole_lines_only(tmp_path: Path) -> None:
    assert parse_completions(RECORD.format(id=7, name="trivial-1", state="COMPLETED")) == [
        Completion("7", "trivial-1", "COMPLETED")]
    path = tmp_path / "jobcomp.txt"
    completions = Completions(path)
    completions.read()  # no job ended yet: no file
    assert completions.ended("trivial-1") == 0
    second = RECORD.format(id=8, name="trivial-1", state="FAILED")
    path.write_text(RECORD.format(id=7, name="trivial-1", state="COMPLETED") + second[:40])
    completions.read()
    assert dict(completions.states["trivial-1"]) == {"COMPLETED": 1}  # the line being written waits
    with path.open("a") as file:
        file.write(second[40:] + RECORD.format(id=9, name="gang-2", state="COMPLETED"))
    completions.read()
    assert dict(completions.states["trivial-1"]) == {"COMPLETED": 1, "FAILED": 1}
    assert completions.ended("trivial-1") == 2 and completions.ended("gang-2") == 1


def test_allocations_are_read_from_the_main_scheduler_and_backfill_lines_to_the_millisecond() -> None:
    log = ("[2026-12-03T08:04:13.499] _slurm_rpc_submit_batch_job: JobId=101 InitPrio=4294901659 usec=436\n"
           "[2026-12-03T08:04:14.066] sched: Allocate JobId=101 NodeList=node[1-8] #CPUs=128 Partition=bench\n"
           "[2026-12-03T08:04:15.250] sched/backfill: _start_job: Started JobId=102 in bench on node[1-8]\n"
           "[2026-12-03T08:04:16.000] sched: Allocate JobId=101 NodeList=node[1-8] #CPUs=128 Partition=bench\n")
    found = parse_allocations(log)
    assert found == {"101": datetime(2026, 12, 3, 8, 4, 14, 66000).timestamp(),
                     "102": datetime(2026, 12, 3, 8, 4, 15, 250000).timestamp()}  # the first allocation counts


def test_a_wide_jobs_launch_runs_from_its_allocation_to_its_last_rank() -> None:
    launch = parse_launch("101", 100.0, "100.05\n100.20\n100.30\n100.25\n")
    assert launch.script == 100.05 and launch.ranks == (100.20, 100.30, 100.25)
    assert launch.seconds == pytest.approx(0.30)


def test_the_fastest_run_is_kept_and_the_counts_to_try_are_read() -> None:
    runs = [Result("trivial", 100, seconds, 1.0, (0.01,), in_flight) for in_flight, seconds in
            ((1, 2.0), (4, 1.5), (16, 1.8))]
    assert fastest(runs).in_flight == 4
    assert in_flight_counts("1,4,16") == (1, 4, 16) and in_flight_counts("16") == (16,)
    with pytest.raises(argparse.ArgumentTypeError):
        in_flight_counts("0")


def test_the_nodes_ports_are_none_of_the_controllers() -> None:
    taken = range(20000, 30000)  # wherever the search starts, it must pass them all
    ports = free_ports(4, taken)
    assert len(set(ports)) == 4 and not set(ports) & set(taken)
