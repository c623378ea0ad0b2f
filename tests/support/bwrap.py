"""Reading a bubblewrap command line back, for the sandbox tests."""

from __future__ import annotations

from collections.abc import Sequence

# bwrap options that take one argument; every other option used takes two (source and target).
_ONE_ARGUMENT = {"--dir": 1, "--proc": 1, "--tmpfs": 1, "--remount-ro": 1, "--chdir": 1}


def ops(argv: Sequence[str]) -> list[tuple[str, ...]]:
    """The bwrap options before the command, each with its arguments."""
    found: list[tuple[str, ...]] = []
    i = 1
    while argv[i] != "--":
        n = _ONE_ARGUMENT.get(argv[i], 2)
        found.append(tuple(argv[i:i + n + 1]))
        i += n + 1
    return found
