"""Reading a bubblewrap command line back, for the sandbox tests."""

from __future__ import annotations

from collections.abc import Sequence

# bwrap options that take no argument or one; every other option used takes two (source and target).
_ARGUMENTS = {"--dir": 1, "--proc": 1, "--tmpfs": 1, "--remount-ro": 1, "--chdir": 1, "--dev": 1, "--cap-drop": 1,
              "--perms": 1,
              "--unshare-pid": 0, "--unshare-ipc": 0, "--unshare-uts": 0, "--unshare-cgroup-try": 0,
              "--unshare-user": 0}


def ops(argv: Sequence[str]) -> list[tuple[str, ...]]:
    """The bwrap options before the command, each with its arguments."""
    found: list[tuple[str, ...]] = []
    i = 1
    while argv[i] != "--":
        n = _ARGUMENTS.get(argv[i], 2)
        found.append(tuple(argv[i:i + n + 1]))
        i += n + 1
    return found
