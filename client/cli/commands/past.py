"""`trainyard at TIME VIEW`: the views of the cluster as they were at a past instant (time travel).

The scheduler rebuilds its state from the events recorded up to TIME and answers the same view from it that it
would have answered then: `list`, `show`, `nodes`, `resources`, `why`, and `queue`, the waiting jobs in the order
it tried them. The commands are the ordinary ones; the group's callback only names the instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from client.cli import runner
from client.cli.commands import cluster, jobs, scheduling
from client.cli.output import print_json, print_table, say
from client.cli.params import JsonOption, past_instant, refusing
from client.cli.render import QUEUE_COLUMNS, local_time, queue_row
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer(no_args_is_help=True, help=(
    "Views of the cluster as they were at a past instant, rebuilt from the events up to it: "
    "trainyard at -2h queue, trainyard at 2026-11-27T03:00 why JOB."))

TimeArgument = Annotated[str, typer.Argument(
    metavar="TIME", help="An ISO time (2026-11-27T03:00, local time unless it names its zone: Z, +01:00) or a time "
                         "ago: -90s, -30m, -2h, -1d.", callback=refusing(past_instant))]


@commands.callback()
def at(time: TimeArgument) -> None:
    """Answer the view that follows as the scheduler would have at TIME."""
    runner.viewing_at = past_instant(time)


@commands.command()
@connected
async def queue(client: TrainyardClient,
                limit: Annotated[int, typer.Option(min=1, max=1000, help="Show the first N.")] = 200,
                as_json: JsonOption = False) -> None:
    """The waiting jobs in the order the scheduler tried them then, with how long each had waited and when each
    was expected to start."""
    listing = await client.waiting(limit)
    if as_json:
        print_json(listing)
        return
    when = client.at
    assert when is not None
    count = listing.waiting if listing.waiting is not None else len(listing.jobs)
    shown = f" (the first {len(listing.jobs)} shown)" if len(listing.jobs) < count else ""
    say(f"at {local_time(when)}: {count} waiting{shown}")
    if listing.jobs:
        print_table(QUEUE_COLUMNS, [queue_row(job, when) for job in listing.jobs])


commands.command("list")(jobs.list_jobs)
commands.command("show")(jobs.show)
commands.command("nodes")(cluster.nodes)
commands.command("resources")(cluster.resources)
commands.command("why")(scheduling.why)
