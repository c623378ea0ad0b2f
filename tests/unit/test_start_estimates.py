"""The start-estimate benchmark beside Slurm (bench/start_estimates.py): its trace, Trainyard's side, and how
Slurm's answers are read. The Slurm run itself is the benchmark's; nothing here starts Slurm."""

from __future__ import annotations

import random
from typing import Any, cast

from bench.slurm import JobTimes, parse_jobs, scheduler_settings
from bench.start_estimates import (
    CAPTURE_SECONDS,
    CPUS,
    MEMORY_MIB,
    SETTLE_SECONDS,
    Outcome,
    SlurmRun,
    TraceJob,
    offered_load,
    rows,
    run_trainyard,
    trace,
)


def test_the_trace_is_seeded_and_keeps_to_its_bounds() -> None:
    jobs = trace(60, random.Random(7), load=0.9, minutes=(1, 4))
    assert jobs == trace(60, random.Random(7), load=0.9, minutes=(1, 4))
    assert jobs != trace(60, random.Random(8), load=0.9, minutes=(1, 4))
    assert [job.index for job in jobs] == list(range(60))
    assert jobs[0].arrival == 0
    assert [job.arrival for job in jobs] == sorted(job.arrival for job in jobs)
    for job in jobs:
        assert 1 <= job.minutes <= 4
        assert 1 <= job.nodes <= 4
        assert job.nodes == 1 or job.cpus == CPUS  # several nodes: whole ones
        assert job.memory_mib == MEMORY_MIB * job.cpus // CPUS
    assert {job.nodes for job in jobs} == {1, 2, 3, 4}
    assert abs(offered_load(jobs) - 0.9) < 0.02


def whole(index: int, arrival: int, minutes: int) -> TraceJob:
    return TraceJob(index=index, arrival=arrival, nodes=4, cpus=CPUS, memory_mib=MEMORY_MIB, minutes=minutes)


def test_trainyard_estimates_a_job_behind_full_nodes_exactly_when_jobs_run_to_their_limits() -> None:
    # Two jobs fill the 8 nodes; the third waits for the first, which ends at 120 s.
    jobs = [whole(0, 0, 2), whole(1, 0, 3), whole(2, 10, 1)]
    first, second, third = run_trainyard(jobs)
    assert (first.waits, first.start, second.waits, second.start) == (False, 0, False, 0)
    assert (third.waits, third.submitted, third.estimate, third.start, third.end) == (True, 10, 120, 120, 180)
    early = run_trainyard(jobs, margin=2)[2]
    assert (early.estimate, early.start) == (120, 118)  # nothing has ended yet to learn from


def told(run: SlurmRun, job_id: str) -> tuple[bool | None, float | None, float | None, float | None]:
    """What a job was told (waits, estimate, later) and when it started."""
    outcome = run.outcomes[job_id]
    return outcome.waits, outcome.estimate, outcome.later, outcome.start


def test_slurms_first_answer_is_its_estimate_or_a_start_and_it_is_read_again_later() -> None:
    jobs = [whole(i, 0, 2) for i in range(3)]
    run = SlurmRun(peer=cast(Any, None), jobs=jobs, origin=1000)
    run.outcomes = {str(i + 1): Outcome(job, submitted=0.0) for i, job in enumerate(jobs)}
    run.returned = {"1": 0.1, "2": 0.1, "3": 0.1}
    run.answering = {"1", "2", "3"}

    def listed(estimate: int | None) -> list[JobTimes]:
        return [JobTimes("1", "est", "RUNNING", 1000, 1001, 1121, "node[1-4]", "", "None"),
                JobTimes("2", "est", "PENDING", 1000, estimate, None, "", "node[5-8]", "Resources"),
                JobTimes("3", "est", "PENDING", 1000, None, None, "", "", "Priority")]

    run.update(listed(None), 0.5)  # the first look: job 1 runs, job 2 has no estimate yet
    assert told(run, "1") == (False, 1, None, 1)
    assert told(run, "2") == (None, None, None, None) and run.answering == {"2", "3"}
    run.update(listed(1150), 1.5)
    assert told(run, "2") == (True, 150, None, None) and run.outcomes["2"].planned == "node[5-8]"
    run.update(listed(1121), SETTLE_SECONDS + 0.5)  # a backfill pass has planned it since
    assert told(run, "2") == (True, 150, 121, None) and not run.settling
    run.update(listed(1121), CAPTURE_SECONDS + 1)  # job 3 never got one
    assert told(run, "3") == (True, None, None, None) and not run.answering
    assert run.lags == [0.4]


def test_rows_count_errors_bounds_and_waits_of_the_queued_jobs_only() -> None:
    job = whole(0, 0, 1)
    outcomes = [Outcome(job, submitted=0, waits=False, estimate=0, start=0, end=60),
                Outcome(job, submitted=0, waits=True, estimate=100, start=100, end=160),
                Outcome(job, submitted=0, waits=True, estimate=100, start=95, end=155),
                Outcome(job, submitted=0, waits=True, estimate=100, start=200, end=260),
                Outcome(job, submitted=0, waits=True, estimate=None, start=50, end=110)]
    figures = dict(rows(outcomes))
    assert figures["said 'starts now'"] == "1, 1 started within 1 s"
    assert figures["  with an estimate"] == "3 of 4"
    assert figures["  started within 1 s / 10 s / 1 min of it"] == "33.3% / 66.7% / 66.7%"
    assert figures["  estimate was an upper bound (started no later)"] == "66.7%"
    assert figures["  median estimated wait / real wait"] == "1.00"
    assert figures["  no estimate"] == "25.0%"


def test_squeue_times_are_read_as_seconds_and_not_known_as_none() -> None:
    text = ("12|est|PENDING|1795763879|N/A|N/A||(null)|Priority\n"
            "13|est|RUNNING|1795763879|1795763880|1795764000|node[1-2]|(null)|None\n"
            "14|est|PENDING|1795763879|1795764000|1795764060||node[3-4]|Resources\n\n")
    assert parse_jobs(text) == [
        JobTimes("12", "est", "PENDING", 1795763879, None, None, "", "", "Priority"),
        JobTimes("13", "est", "RUNNING", 1795763879, 1795763880, 1795764000, "node[1-2]", "", "None"),
        JobTimes("14", "est", "PENDING", 1795763879, 1795764000, 1795764060, "", "node[3-4]", "Resources")]
    assert parse_jobs("15|est|PENDING|1795763879|Unknown|0|||Resources\n")[0].start is None


def test_scheduler_parameters_replace_the_defaults_with_the_same_key_and_add_the_rest() -> None:
    assert scheduler_settings(("a=1", "b=2"), ("b=3", "bf_interval=1", "bf_continue")) == (
        "a=1", "b=3", "bf_interval=1", "bf_continue")
    assert scheduler_settings(("a=1",), ()) == ("a=1",)
