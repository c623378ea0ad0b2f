"""Everything the CLI writes: lines, tables, JSON, log lines and errors.

Text is written as given, never read as markup, so names, reasons and log lines from the services
print as they are; styles come with the text as `(text, style)`. What a terminal would obey in them
(escape sequences, other control characters) is written out visibly (`render.shown`), here, for every
piece of text printed, so a job's name or log line cannot recolour, move, retitle or clear the
caller's terminal; only `logs --raw` prints log lines as received. rich is imported when something is
first written, which keeps it out of the start-up of a command that fails early or only connects.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import msgspec
import typer

from client.cli.render import Styled, shown

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from libs.contracts.jobspec import FieldError


@cache
def stdout() -> Console:
    from rich.console import Console

    # Piped output is not cut to 80 columns: tables stay one row per item for grep and friends.
    return Console(highlight=False, width=None if os.isatty(1) else int(os.environ.get("COLUMNS", "200")))


@cache
def stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def text(*parts: Styled, style: str = "", layout: bool = False) -> Text:
    """The parts as one rich Text, their control characters written out (`layout`: but newlines and tabs)."""
    from rich.text import Text

    return Text.assemble(*(visible(part, layout=layout) for part in parts), style=style)


def visible(part: Styled, *, layout: bool = False) -> Styled:
    if isinstance(part, str):
        return shown(part, layout=layout)
    content, style = part
    return shown(content, layout=layout), style


def say(*parts: Styled, style: str = "", soft_wrap: bool = False) -> None:
    """Write one line (an empty one without parts) to stdout; piped, it is never cut into several."""
    stdout().print(text(*parts, style=style), soft_wrap=soft_wrap or not os.isatty(1))


def note(*parts: Styled) -> None:
    """Write a dimmed line to stderr: what goes with the output without being part of it."""
    stderr().print(text(*parts), style="dim")


def table(columns: Sequence[str], rows: Iterable[Sequence[Styled]], *, title: str | None = None) -> Table:
    from rich.table import Table

    # A title given as a string would be read as markup.
    grid = Table(box=None, header_style="bold", title=text(title) if title is not None else None,
                 title_justify="left")
    for column in columns:
        grid.add_column(column)
    for row in rows:
        grid.add_row(*(text(cell) for cell in row))
    return grid


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Styled]], *, title: str | None = None) -> None:
    stdout().print(table(columns, rows, title=title))


def print_pairs(rows: Iterable[tuple[str, Styled]]) -> None:
    """Key and value per line, keys in bold."""
    from rich.table import Table

    grid = Table(box=None, show_header=False)
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows:
        grid.add_row(text(key), text(value))
    stdout().print(grid)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


def print_json_line(value: Any) -> None:
    """One value as one line of JSON, flushed at once (for output that is followed)."""
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    sys.stdout.flush()


def print_log_lines(rank: int, lines: Iterable[str], *, prefix: bool, raw: bool = False) -> None:
    """A job's log lines, never re-wrapped; `raw`: exactly as received, escape sequences and all."""
    if raw:
        head = f"[rank {rank}] " if prefix else ""
        sys.stdout.write("".join(f"{head}{line}\n" for line in lines))
        sys.stdout.flush()
        return
    for line in lines:
        parts: tuple[Styled, ...] = ((f"[rank {rank}] ", "blue"), line) if prefix else (line,)
        stdout().print(text(*parts, layout=True), soft_wrap=True)


def print_field_errors(errors: Iterable[FieldError]) -> None:
    for error in errors:
        stderr().print(text("  ", (error.field, "red"), f": {error.message}"))
        if error.hint:
            stderr().print(text(("    hint: " + error.hint, "dim")))


def fail(message: str, hint: str | None = None) -> typer.Exit:
    """Write an error and what to do next to stderr; the caller raises the exit returned."""
    stderr().print(text(("error:", "bold red"), " ", message))
    if hint:
        stderr().print(text(("hint:", "dim"), " ", hint))
    return typer.Exit(1)
