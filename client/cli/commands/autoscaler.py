"""`trainyard autoscaler` (A6): what the autoscaler started and why, as the seed's dashboard shows it."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import print_json, print_json_line, print_table, say
from client.cli.params import JsonOption
from client.cli.render import (
    AUTOSCALER_LOG_COLUMNS,
    AUTOSCALER_LOG_WIDTHS,
    SCALED_COLUMNS,
    alert_line,
    autoscaler_log_row,
    autoscaler_summary,
    scaled_cells,
)
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()


class View(StrEnum):
    status = "status"
    log = "log"


@commands.command()
@connected
async def autoscaler(client: TrainyardClient,
                     view: Annotated[View, typer.Argument(help="status: instances, queues and cooldowns; log: "
                                                          "the autoscaler's own log.")] = View.status,
                     follow: Annotated[bool, typer.Option("--follow", "-f", help="With log: then print new entries "
                                                          "as they are recorded, until Ctrl-C.")] = False,
                     as_json: JsonOption = False) -> None:
    """The autoscaler (A6): idle, busy and coming instances, jobs per queue, cooldowns; or its own log."""
    if view is View.log:
        if as_json:
            async for envelope in client.autoscaler_log(follow=follow):
                print_json_line(envelope)
        elif follow:
            say(alert_line(AUTOSCALER_LOG_COLUMNS, AUTOSCALER_LOG_WIDTHS), style="bold", soft_wrap=True)
            async for envelope in client.autoscaler_log(follow=True):
                say(alert_line(autoscaler_log_row(envelope), AUTOSCALER_LOG_WIDTHS), soft_wrap=True)
        elif rows := [autoscaler_log_row(envelope) async for envelope in client.autoscaler_log()]:
            print_table(AUTOSCALER_LOG_COLUMNS, rows)
        else:
            say("the autoscaler has recorded nothing yet")
        return
    status = await client.queue_status()
    if as_json:
        print_json(status)
        return
    for line in autoscaler_summary(status, datetime.now(UTC)):
        say(line)
    if status.instances:
        print_table(SCALED_COLUMNS, [scaled_cells(instance) for instance in status.instances])
