"""R2: a series drawn in the terminal and to a PNG file, thinned without losing its spikes, and the run's life
as `trainyard metrics` tells it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from client.cli.render import run_life_lines
from client.plots import lines_of, png_chart, terminal_chart, thinned
from libs.contracts.codec import encode
from libs.contracts.operations.runs import MAX_SERIES_PAGE, ProcessView, RankEnd, RunView, SeriesPage, SeriesPoint

AT = datetime(2026, 1, 1, tzinfo=UTC)


def point(step: int | None, value: float, rank: int = 0, task: int = 0, attempt: int = 1) -> SeriesPoint:
    return SeriesPoint(rank=rank, step=step, value=value, at=AT, task=task, attempt=attempt)


def test_a_step_logged_again_by_a_later_attempt_replaces_the_earlier_value_and_lines_follow_steps() -> None:
    points = [point(0, 5.0), point(1, 4.0), point(2, 3.0), point(0, 9.0, rank=1),
              point(2, 2.5, attempt=2), point(3, 2.0, attempt=2)]  # attempt 2 resumed from step 2
    lines = lines_of(points)
    assert lines["rank 0"] == ([0.0, 1.0, 2.0, 3.0], [5.0, 4.0, 2.5, 2.0])
    assert lines["rank 1"] == ([0.0], [9.0])
    unnumbered = lines_of([point(None, 1.0, task=2), point(None, 2.0, task=2)])
    assert unnumbered == {"task 2 rank 0": ([0.0, 1.0], [1.0, 2.0])}


def test_a_thinned_line_keeps_its_spikes_and_its_order() -> None:
    xs = [float(x) for x in range(100_000)]
    ys = [1.0] * 100_000
    ys[77_777] = 50.0
    ys[12_345] = -3.0
    thin_x, thin_y = thinned((xs, ys), 1_000)
    assert len(thin_x) <= 1_000
    assert max(thin_y) == 50.0 and min(thin_y) == -3.0
    assert thin_x == sorted(thin_x)
    assert thinned(([1.0, 2.0], [3.0, 4.0]), 1_000) == ([1.0, 2.0], [3.0, 4.0])


def test_a_series_is_drawn_in_the_terminal_and_to_a_png(tmp_path: Path) -> None:
    lines = lines_of([point(step, 10.0 / (step + 1)) for step in range(500)] +
                     [point(step, 12.0 / (step + 1), rank=1) for step in range(500)])
    chart = terminal_chart(lines, "loss of job-1", width=80, height=20)
    assert "loss of job-1" in chart and "rank 0" in chart and "rank 1" in chart
    assert "\x1b" not in chart  # no colour codes in a file or a pipe
    png = tmp_path / "loss.png"
    png_chart(lines, "loss of job-1", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000


def test_the_run_s_life_says_who_finished_it_and_which_ranks_ended_badly() -> None:
    assert run_life_lines(RunView(job_id="j", series=[])) == ["run: waiting for the job's first process"]
    view = RunView(job_id="j", series=[], state="finished", began_at=AT, attempts=[1, 2], finished_at=AT,
                   finished_by="rank 0 ended",
                   ended=[RankEnd(attempt=1, task=0, rank=1, node="n2", exit_code=-9, ended_at=AT),
                          RankEnd(attempt=1, task=0, rank=0, node="n1", exit_code=None, ended_at=AT),
                          RankEnd(attempt=2, task=0, rank=0, node="n1", exit_code=0, ended_at=AT)],
                   processes=[ProcessView(attempt=1, task=0, rank=r, node="n1", process=f"pid-{r}", points=10,
                                          finished_at=AT if r else None) for r in range(3)])
    first, processes, *ends = run_life_lines(view)
    assert processes.strip() == "3 processes logged into it, 2 of them finished their logging"
    assert first.startswith("run: finished ") and "rank 0 ended" in first and "attempts 1, 2" in first
    assert len(ends) == 2  # the ranks that ended well are not listed
    assert "rank 1 of attempt 1 on n2 exited with -9" in ends[0]
    assert "rank 0 of attempt 1 on n1 was lost with its node" in ends[1]


def test_a_full_page_of_a_series_fits_in_one_nats_message() -> None:
    longest = SeriesPoint(rank=4095, step=2**62, value=-1.2345678901234567e-300, at=AT.replace(microsecond=999_999),
                          task=4095, attempt=99, process="p" * 64, seq=2**62, node="n" * 63)
    page = SeriesPage(points=[longest] * MAX_SERIES_PAGE, next_after=2**62, more=True)
    assert len(encode(page)) < 1024 * 1024  # NATS's default max payload
