"""`trainyard cache` (D1, D2, J10): what each node keeps of the datasets data preparation copied there, and the
images it keeps unpacked; `trainyard cache preload` copies a dataset there ahead of the jobs that read it."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, print_json, print_table, say, stdout
from client.cli.params import JsonOption, refusing
from client.cli.render import CACHE_COLUMNS, cache_rows, cache_summary, local_time, shown
from client.cli.runner import connected, with_client

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from client.preload import NodePreload
    from libs.contracts.operations.cache import NodeCache

commands = typer.Typer()
cache_commands = typer.Typer(help="The nodes' dataset and image caches (D1, D2, J10): list them, or preload a "
                             "dataset.")
commands.add_typer(cache_commands, name="cache")
CLOCK_SLACK = timedelta(seconds=2)  # the nodes' clocks against this one's
IMAGE_COLUMNS = ("NODE", "IMAGE", "DIGEST", "FORMAT", "SIZE (MiB)", "UNPACKED", "LAST USE", "USED BY")


@cache_commands.callback(invoke_without_command=True)
def cache(context: typer.Context,
          node: Annotated[str | None, typer.Option("--node", "-n", help="Only this node's cache.")] = None,
          as_json: JsonOption = False) -> None:
    """The nodes' dataset caches (each entry's dataset, size, last use and the jobs using it now), then the
    images each node keeps unpacked."""
    if context.invoked_subcommand is None:
        with_client(lambda client: _list(client, node, as_json))


async def _list(client: TrainyardClient, node: str | None, as_json: bool) -> None:
    caches = await client.cache(node)
    if as_json:
        print_json(caches)
        return
    if not caches:
        say("no node has reported a dataset cache yet" + (f" ({node})" if node else ""))
        return
    for found in caches:
        say(cache_summary(found), style="bold")
        if not found.complete:
            held = f"{found.total_entries} entries" if found.total_entries is not None else "more entries"
            say(f"  {found.node} holds {held}: only its {len(found.entries)} most recently used are listed")
    if rows := [row for found in caches for row in cache_rows(found)]:
        print_table(CACHE_COLUMNS, rows)
    if images := [row for found in caches for row in image_rows(found)]:
        print_table(IMAGE_COLUMNS, images, title="unpacked images")


def image_rows(cache: NodeCache) -> list[tuple[str, ...]]:
    """J10: a node's unpacked images, the reference they were unpacked for ("-" when its agent did not keep it)."""
    return [(cache.node, image.ref or "-", image.digest.removeprefix("sha256:")[:12], image.format,
             f"{image.bytes / 2**20:.1f}", local_time(image.unpacked_at), local_time(image.last_used),
             ", ".join(pin.split("/")[0] for pin in dict.fromkeys(image.pins)) or "-") for image in cache.images]


def dataset_and_version(text: str) -> tuple[str, str | None]:
    name, _, version = text.partition(":")
    if not name or (":" in text and not version):
        raise typer.BadParameter(f"{text!r} is not DATASET or DATASET:VERSION")
    return name, version or None


@cache_commands.command("preload")
@connected
async def preload(client: TrainyardClient,
                  dataset: Annotated[str, typer.Argument(metavar="DATASET[:VERSION]", help="The dataset to copy.",
                                                         callback=refusing(dataset_and_version))],
                  nodes: Annotated[list[str] | None, typer.Option("--node", "--nodes", "-n",
                                                                  help="A node to copy it to (repeatable).")] = None,
                  flavor: Annotated[str | None, typer.Option("--flavor", "-f", help="Every node that takes work "
                                                             "and holds a rank of this flavor.")] = None,
                  wait: Annotated[bool, typer.Option(help="Show each node's progress until all are done.")] = True,
                  as_json: JsonOption = False) -> None:
    """Copy a dataset into the caches of chosen nodes ahead of the jobs that read it (D2)."""
    name, version = dataset_and_version(dataset)
    since = datetime.now(UTC) - CLOCK_SLACK
    accepted = await client.preload(name, version, nodes=nodes or [], flavor=flavor)
    if as_json:
        print_json(accepted)
    else:
        say(f"preloading {accepted.source} on {', '.join(accepted.nodes)}")
    if not wait:
        return
    states: list[NodePreload] = []
    if sys.stdout.isatty() and not as_json:
        from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

        # Node names are not the CLI's own text: not read as markup, their control characters written out.
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=stdout()) as bars:
            tasks: dict[str, TaskID] = {node: bars.add_task(shown(node), total=None) for node in accepted.nodes}
            async for states in client.preload_progress(accepted, since):
                for state in states:
                    bars.update(tasks[state.node], description=shown(f"{state.node} {state.state}"),
                                completed=state.done_bytes, total=state.total_bytes or None)
    else:
        async for states in client.preload_progress(accepted, since):
            for state in states:
                if not as_json:
                    say(f"{state.node}: {state.state}" + (f" {state.done_bytes / 2**20:.1f}/"
                                                          f"{state.total_bytes / 2**20:.1f} MiB"
                                                          if state.total_bytes else ""))
    failed = [state for state in states if state.state == "failed"]
    if failed:
        raise fail("; ".join(f"{state.node}: {state.reason}" for state in failed),
                   hint="`trainyard cache --node NODE` shows what the node holds")
    if not as_json:
        say(f"{accepted.source} is in the cache of {', '.join(accepted.nodes)}")
