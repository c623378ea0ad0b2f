"""`trainyard metrics` (R2): a job's run, the series its processes logged, and a series' values.

Rank 0's series come first, as rank > 0 is kept out of the way (`000_*`); with several ranks, a row per
name gives the figures across ranks; `--all-ranks` shows every rank's series. A series' values print as
a table, follow as they are logged (`--follow`), export (`--csv`, `--json`) or draw (`--plot` in the
terminal, `--png FILE`).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, note, print_json, print_json_line, print_pairs, print_table, say
from client.cli.params import JobIdArgument, JsonOption
from client.cli.render import (
    SERIES_COLUMNS,
    VALUE_COLUMNS,
    run_life_lines,
    series_rows,
    shown,
    value_line,
    value_row,
)
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from libs.contracts.operations.runs import RunView, SeriesPoint

commands = typer.Typer()


@commands.command()
@connected
async def metrics(client: TrainyardClient, job_id: JobIdArgument,
                  name: Annotated[str | None, typer.Argument(help="A series to print the values of.")] = None,
                  rank: Annotated[int | None, typer.Option("--rank", "-r", min=0, help="This rank's values (default "
                                                           "0).")] = None,
                  all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Every rank's series or values.")]
                  = False,
                  follow: Annotated[bool, typer.Option("--follow", "-f", help="Go on printing the values logged, "
                                                       "until the job ends.")] = False,
                  plot: Annotated[bool, typer.Option("--plot", help="Draw the series in the terminal.")] = False,
                  png: Annotated[Path | None, typer.Option("--png", help="Draw the series to this PNG file.",
                                                           dir_okay=False)] = None,
                  as_csv: Annotated[bool, typer.Option("--csv", help="The values as CSV.")] = False,
                  as_json: JsonOption = False) -> None:
    """A job's run: its series with last, least and greatest values; with NAME, that series' values."""
    if name is None:
        if follow or plot or png or as_csv:
            raise fail("--follow, --plot, --png and --csv are for one series' values",
                       hint=f"name the series: `trainyard metrics {job_id} loss --plot`")
        show_run(await client.run(job_id), job_id, all_ranks=all_ranks, as_json=as_json)
        return
    if sum((follow, plot or png is not None, as_csv, as_json)) > 1:
        raise fail("choose one of --follow, --plot/--png, --csv and --json",
                   hint="each prints the values its own way")
    wanted = None if all_ranks else (rank or 0)
    points = client.series(job_id, name, wanted, follow=follow)
    whose = "" if all_ranks else f" from rank {wanted}"
    if plot or png is not None:
        await draw(points, job_id, name, whose, terminal=plot, png=png)
    elif as_json:
        async for point in points:
            print_json_line(point)
    elif as_csv:
        out = csv.writer(sys.stdout)
        out.writerow(["step", "rank", "task", "attempt", "value", "at", "node", "process"])
        # CSV is read in terminals too: the job's own labels have their control characters written out.
        async for point in points:
            out.writerow([point.step if point.step is not None else "", point.rank, point.task, point.attempt,
                          point.value, point.at.isoformat(), shown(point.node), shown(point.process)])
    elif follow:
        say(value_line(VALUE_COLUMNS), style="bold")
        async for point in points:
            say(value_line(value_row(point)))
    else:
        rows = [value_row(point) async for point in points]
        if rows:
            print_table(VALUE_COLUMNS, rows)
        else:
            say(f"no values of {name!r} in {job_id}{whose}")


def show_run(view: RunView, job_id: str, *, all_ranks: bool, as_json: bool) -> None:
    if as_json:
        print_json(view)
        return
    for line in run_life_lines(view):
        say(line)
    if not view.series:
        say(f"{job_id} has logged no metrics (`from trainyard import run; run.log({{...}})` in the job)")
    else:
        print_table(SERIES_COLUMNS, series_rows(view.series, all_ranks=all_ranks))
    if view.config:
        print_pairs([(f"config {key}", str(value)) for key, value in sorted(view.config.items())])
    if view.summary:
        print_pairs([(f"summary {key}", str(value)) for key, value in sorted(view.summary.items())])


async def draw(points: AsyncIterator[SeriesPoint], job_id: str, name: str, whose: str, *, terminal: bool,
               png: Path | None) -> None:
    from client.plots import chart_title, lines_of, png_chart, terminal_chart

    collected: list[SeriesPoint] = []
    async for point in points:
        collected.append(point)
        if len(collected) % 100_000 == 0:
            note(f"read {len(collected):,} values of {name}…")
    if not collected:
        raise fail(f"no values of {name!r} in {job_id}{whose}", hint=f"`trainyard metrics {job_id}` lists the series")
    lines = lines_of(collected)
    title = chart_title(job_id, name, list(lines))
    if png is not None:
        png_chart(lines, title, png)
        note(f"wrote {png} ({len(collected):,} values)")
    if terminal:
        sys.stdout.write(terminal_chart(lines, shown(title), color=sys.stdout.isatty()) + "\n")
