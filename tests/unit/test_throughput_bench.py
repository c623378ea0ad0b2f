"""The throughput benchmark's rounds (bench/throughput.py): each side's tries turn with the rounds, and a round
shows every try beside the fastest, which is its figure."""

from __future__ import annotations

from bench.throughput import Figures, Run, SlurmSide, report, turned


def test_the_counts_tried_turn_with_the_rounds_so_that_none_is_always_first() -> None:
    counts = (8, 16, 32)
    assert [turned(counts, turn) for turn in (1, 2, 3, 4)] == [(8, 16, 32), (16, 32, 8), (32, 8, 16), (8, 16, 32)]


def test_a_round_reports_every_try_and_its_fastest_against_slurm_s_fastest() -> None:
    figures = Figures(runs={"trivial": Run(jobs=1000, seconds=8.0, submit_seconds=7.0, latencies=[0.1])},
                      tried={8: 110.0, 16: 125.0, 32: 120.0}, in_flight=16)
    side = SlurmSide(rates={"trivial": 62.5}, settings="MinJobAge=2", tried={1: 60.0, 4: 62.5, 16: 61.0},
                     in_flight=4)
    lines = report(figures, side)
    trivial = next(line for line in lines if line.startswith("trivial"))
    assert trivial.split()[3] == "125.0" and trivial.split()[-2:] == ["62.5", "2.00"]
    assert "Trainyard trivial by submissions at once: 8: 110.0 jobs/s, 16: 125.0 jobs/s, 32: 120.0 jobs/s; " \
           "kept 16" in lines
    assert "Slurm trivial by sbatch at once: 1: 60.0 jobs/s, 4: 62.5 jobs/s, 16: 61.0 jobs/s; kept 4" in lines
