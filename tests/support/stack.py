"""The whole-stack harness as the end-to-end tests drive it: through the Python client."""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

from client.api import TrainyardClient
from devstack import harness

Stack: TypeAlias = harness.Stack[TrainyardClient]


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody reaped (an orphan under a container's init) is dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
