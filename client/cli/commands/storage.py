"""`trainyard storage`: owners of resources in shared storage, and what others may do with them (J2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, get_args

import typer

from client.cli.output import fail, print_json, print_table, say
from client.cli.params import JsonOption, refusing
from client.cli.render import STORAGE_COLUMNS, storage_row
from client.cli.runner import connected
from libs.contracts.jobspec import Access
from libs.contracts.scheduling import StoredKind

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer(help="Owners of resources in shared storage, and what others may do with them (J2).",
                       no_args_is_help=True)

STORED_KINDS: tuple[StoredKind, ...] = get_args(StoredKind)
ACCESS_LEVELS: tuple[Access, ...] = get_args(Access)


def stored_kind(kind: str) -> StoredKind:
    for known in STORED_KINDS:
        if kind == known:
            return known
    raise fail(f"{kind!r} is not a kind of stored resource", f"choose from: {', '.join(STORED_KINDS)}")


def optional_stored_kind(kind: str | None) -> StoredKind | None:
    return None if kind is None else stored_kind(kind)


def access_level(others: str) -> Access:
    for known in ACCESS_LEVELS:
        if others == known:
            return known
    raise fail(f"--others takes {', '.join(ACCESS_LEVELS)}, not {others!r}", "e.g. --others read-only")


@commands.command("access")
@connected
async def storage_access(client: TrainyardClient,
                         kind: Annotated[str, typer.Argument(metavar="KIND", help=f"One of: {', '.join(STORED_KINDS)}.",
                                                             callback=refusing(stored_kind))],
                         name: Annotated[str, typer.Argument(help="The resource's name (every version of it).")],
                         others: Annotated[str, typer.Option(metavar="read-write|read-only|none",
                                                             help="What the other members of the project may do.",
                                                             callback=refusing(access_level))],
                         project: Annotated[str, typer.Option(help="The project whose members it is shared with.")]
                         = "default",
                         owner: Annotated[str | None, typer.Option(help="Administrators: register it to this user.")]
                         = None,
                         as_json: JsonOption = False) -> None:
    """Register a resource to yourself, or change what others in its project may do with it.

    A job's access for others may never exceed its creator's own access to the resources it uses;
    resources nobody registered are open to everyone.
    """
    entry = await client.set_storage_access(stored_kind(kind), name, project=project, others=access_level(others),
                                            owner=owner)
    if as_json:
        print_json(entry)
        return
    print_table(STORAGE_COLUMNS, [storage_row(entry)])


@commands.command("list")
@connected
async def storage_list(client: TrainyardClient,
                       kind: Annotated[str | None, typer.Option(help="Only this kind.",
                                                                callback=refusing(optional_stored_kind))] = None,
                       as_json: JsonOption = False) -> None:
    """Registered resources of your projects and your own (resources not listed are open to everyone)."""
    entries = await client.storage_access(optional_stored_kind(kind))
    if as_json:
        print_json(entries)
    elif not entries:
        say("no registered resources: everything in shared storage is open to everyone")
    else:
        print_table(STORAGE_COLUMNS, [storage_row(entry) for entry in entries])
