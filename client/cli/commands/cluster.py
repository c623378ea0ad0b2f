"""Views of the platform: nodes, queue, resources (S7), flavors (S8), alerts (M7) and whoami."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, print_json, print_json_line, print_pairs, print_table, say
from client.cli.params import JsonOption, refusing
from client.cli.render import (
    ALERT_COLUMNS,
    DEMAND_COLUMNS,
    FLAVOR_COLUMNS,
    NODE_COLUMNS,
    RESOURCE_COLUMNS,
    SCALED_COLUMNS,
    alert_line,
    alert_row,
    demand_row,
    flavor_row,
    identity_rows,
    node_cells,
    resource_row,
    scaled_cells,
)
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()


@commands.command()
@connected
async def nodes(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """List registered nodes with their resources and use."""
    views = await client.nodes()
    if as_json:
        print_json(views)
    elif not views:
        say("no nodes registered")
    else:
        print_table(NODE_COLUMNS, [node_cells(view) for view in views])


@commands.command()
@connected
async def queue(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """Show demand as the autoscaler sees it: queued jobs per flavor, and the instances it started."""
    status = await client.queue_status()
    if as_json:
        print_json(status)
        return
    say(f"queued jobs: {status.queued_jobs}   running jobs: {status.running_jobs}")
    for flavor, count in status.queued_by_flavor.items():
        say(f"  {flavor}: {count} queued")
    if status.instances:
        print_table(SCALED_COLUMNS, [scaled_cells(instance) for instance in status.instances])


def asked_flavors(flavors: list[str] | None) -> list[str]:
    if not flavors:
        raise fail("name at least one flavor", "e.g. trainyard resources --flavor cpu-2; `trainyard flavors` "
                   "lists them")
    return flavors


@commands.command()
@connected
async def resources(client: TrainyardClient,
                    flavor: Annotated[list[str] | None, typer.Option(
                        "--flavor", help="A flavor to place (repeatable).", callback=refusing(asked_flavors))] = None,
                    as_json: JsonOption = False) -> None:
    """Show the schedulable nodes for flavors: fit, OS, memory, CPUs, boards and who uses them (S7)."""
    asked = asked_flavors(flavor)
    found = await client.resources(asked)
    if as_json:
        print_json(found)
    elif not found:
        say(f"no schedulable node for {', '.join(asked)}")
    else:
        print_table(RESOURCE_COLUMNS, [resource_row(node) for node in found])


@commands.command()
@connected
async def flavors(client: TrainyardClient,
                  board: Annotated[str | None, typer.Option(help="Only flavors of this board model.")] = None,
                  as_json: JsonOption = False) -> None:
    """List flavors, and the boards of each model that queued jobs need (S8)."""
    listing = await client.flavors(board)
    if as_json:
        print_json(listing)
        return
    if listing.flavors:
        print_table(FLAVOR_COLUMNS, [flavor_row(info) for info in listing.flavors])
    else:
        say("no flavors" + (f" with board {board}" if board else ""))
    say()
    if not listing.demand:
        say("no queued job needs boards")
        return
    print_table(DEMAND_COLUMNS, [demand_row(entry) for entry in listing.demand], title="queued demand")


@commands.command()
@connected
async def alerts(client: TrainyardClient,
                 follow: Annotated[bool, typer.Option("--follow", "-f", help="Then print new alerts as they are "
                                                      "raised, until Ctrl-C.")] = False,
                 as_json: Annotated[bool, typer.Option("--json", help="Print each alert's event envelope as one "
                                                       "line of JSON.")] = False) -> None:
    """List the alerts you may see (M7): unhealthy and lost nodes, moved jobs, slow ranks, failed pre-checks."""
    if as_json:
        async for envelope in client.alerts(follow=follow):
            print_json_line(envelope)
        return
    if follow:
        say(alert_line(ALERT_COLUMNS), style="bold", soft_wrap=True)
        async for envelope in client.alerts(follow=True):
            say(alert_line(alert_row(envelope)), soft_wrap=True)
        return
    rows = [alert_row(envelope) async for envelope in client.alerts()]
    if rows:
        print_table(ALERT_COLUMNS, rows)
    else:
        say("no alerts")


@commands.command()
@connected
async def whoami(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """Show who the services take you for: the user, projects and role in your token."""
    identity = await client.whoami()
    if as_json:
        print_json(identity)
        return
    print_pairs(identity_rows(identity))
