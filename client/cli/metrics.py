"""`trainyard metrics` (R2): a job's run, the series its processes logged, and a series' values.

Rank 0's series come first, as rank > 0 is kept out of the way (`000_*`); with several ranks, a row per
name gives the figures across ranks; `--all-ranks` shows every rank's series.
"""

from __future__ import annotations

import csv
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import print_json, print_json_line, print_pairs, print_table, say
from client.cli.params import JobIdArgument, JsonOption
from client.cli.render import SERIES_COLUMNS, VALUE_COLUMNS, series_rows, value_row
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()


@commands.command()
@connected
async def metrics(client: TrainyardClient, job_id: JobIdArgument,
                  name: Annotated[str | None, typer.Argument(help="A series to print the values of.")] = None,
                  rank: Annotated[int | None, typer.Option("--rank", "-r", min=0, help="This rank's values (default "
                                                           "0).")] = None,
                  all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Every rank's series or values.")]
                  = False,
                  as_csv: Annotated[bool, typer.Option("--csv", help="The values as CSV.")] = False,
                  as_json: JsonOption = False) -> None:
    """A job's run: its series with last, least and greatest values; with NAME, that series' values."""
    if name is None:
        view = await client.run(job_id)
        if as_json:
            print_json(view)
            return
        if not view.series:
            say(f"{job_id} has logged no metrics (`from trainyard import run; run.log({{...}})` in the job)")
        else:
            print_table(SERIES_COLUMNS, series_rows(view.series, all_ranks=all_ranks))
        if view.config:
            print_pairs([(f"config {key}", str(value)) for key, value in sorted(view.config.items())])
        if view.summary:
            print_pairs([(f"summary {key}", str(value)) for key, value in sorted(view.summary.items())])
        return
    wanted = None if all_ranks else (rank or 0)
    points = client.series(job_id, name, wanted)
    if as_json:
        async for point in points:
            print_json_line(point)
    elif as_csv:
        out = csv.writer(sys.stdout)
        out.writerow(["step", "rank", "task", "attempt", "value", "at"])
        async for point in points:
            out.writerow([point.step if point.step is not None else "", point.rank, point.task, point.attempt,
                          point.value, point.at.isoformat()])
    else:
        rows = [value_row(point) async for point in points]
        if rows:
            print_table(VALUE_COLUMNS, rows)
        else:
            say(f"no values of {name!r} in {job_id}" + ("" if all_ranks else f" from rank {wanted}"))
