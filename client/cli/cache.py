"""`trainyard cache` (D1, D2): what each node keeps of the datasets data preparation copied there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import print_json, print_table, say
from client.cli.params import JsonOption
from client.cli.render import CACHE_COLUMNS, cache_rows, cache_summary
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()


@commands.command()
@connected
async def cache(client: TrainyardClient,
                node: Annotated[str | None, typer.Option("--node", "-n", help="Only this node's cache.")] = None,
                as_json: JsonOption = False) -> None:
    """The nodes' dataset caches: each entry's dataset, size, last use and the jobs using it now."""
    caches = await client.cache(node)
    if as_json:
        print_json(caches)
        return
    if not caches:
        say("no node has reported a dataset cache yet" + (f" ({node})" if node else ""))
        return
    for found in caches:
        say(cache_summary(found), style="bold")
    if rows := [row for found in caches for row in cache_rows(found)]:
        print_table(CACHE_COLUMNS, rows)
