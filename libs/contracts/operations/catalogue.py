"""Every operation, gathered from the area modules: what the services' route tables, the client, the NATS
permissions (libs/natsroles.py) and docs/cli.md read.

A module of `libs/contracts/operations` that declares an `Operation` at module level is part of the
catalogue; adding an operation is declaring it there.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from functools import reduce
from operator import or_
from typing import Any

from libs.contracts import operations
from libs.contracts.operations.base import Answerer, Caller, CommandError, Operation


def _gathered() -> tuple[Operation[Any, Any], ...]:
    found: list[Operation[Any, Any]] = []
    for module_info in pkgutil.iter_modules(operations.__path__):
        if module_info.name in ("base", "catalogue"):
            continue
        module = importlib.import_module(f"{operations.__name__}.{module_info.name}")
        found += [value for value in vars(module).values() if isinstance(value, Operation)]
    return tuple(sorted(found, key=lambda operation: operation.name))


OPERATIONS: tuple[Operation[Any, Any], ...] = _gathered()
BY_SUBJECT: Mapping[str, Operation[Any, Any]] = {operation.subject: operation for operation in OPERATIONS}
BY_NAME: Mapping[str, Operation[Any, Any]] = {operation.name: operation for operation in OPERATIONS}


def answered_by(answerer: Answerer) -> tuple[Operation[Any, Any], ...]:
    return tuple(operation for operation in OPERATIONS if operation.answered_by == answerer)


def sent_by(caller: Caller) -> tuple[Operation[Any, Any], ...]:
    return tuple(operation for operation in OPERATIONS if caller in operation.callers)


def _union(types: set[Any]) -> Any:
    return reduce(or_, sorted(types, key=lambda kind: kind.__name__))


# What people send and what they get back, as unions of every such type: for the JSON Schemas and for a
# caller that reads a reply without knowing its operation.
PEOPLE_REQUESTS: Any = _union({operation.request for operation in sent_by("user")})
PEOPLE_REPLIES: Any = _union({operation.reply for operation in sent_by("user")}
                             | {operation.progress for operation in sent_by("user") if operation.progress}
                             | {CommandError})


# --- docs/cli.md's list of operations ------------------------------------------------------------------------

BEGIN_TABLE = "<!-- operations: generated from libs/contracts/operations by `make schemas`; do not edit -->"
END_TABLE = "<!-- operations: end -->"


def operations_table() -> str:
    """Every operation people send, as the Markdown table docs/cli.md shows between its markers."""
    rows = ["| operation | subject | request → reply | answered by | changes state | what it does |",
            "|---|---|---|---|---|---|"]
    for operation in sent_by("user"):
        rows.append(f"| `{operation.name}` | `{operation.subject}` | `{operation.request.__name__}` → "
                    f"`{operation.reply.__name__}` | {operation.answered_by} | "
                    f"{'yes' if operation.changes_state else 'no'} | {operation.summary} |")
    return "\n".join([BEGIN_TABLE, *rows, END_TABLE])


def with_operations_table(page: str) -> str:
    """`page` with the table between its markers made anew."""
    start, end = page.index(BEGIN_TABLE), page.index(END_TABLE) + len(END_TABLE)
    return page[:start] + operations_table() + page[end:]


def main() -> None:
    """`python -m libs.contracts.operations.catalogue PAGE`: write the table of operations into PAGE."""
    import sys
    from pathlib import Path

    page = Path(sys.argv[1])
    page.write_text(with_operations_table(page.read_text()))


if __name__ == "__main__":
    main()
