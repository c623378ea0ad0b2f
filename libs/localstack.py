"""Where the local stack (`make up`) keeps its state, and the file in which it tells clients how to reach it.

The development tooling (the top-level `devstack` package) writes `stack.env` when it starts the stack and
removes it when it stops it; the CLI and the Python client read it when no variable of their own names NATS,
a token or the signing secret. Both take the folder and the file's format from here, so the client never
imports the tooling. The file holds one `export NAME=value` line per variable (a shell can source it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# The folder of the local stack's state: the signing secret, tokens, stack.env, the servers' data and the logs.
HOME_VARIABLE = "TRAINYARD_HOME"
# Without TRAINYARD_HOME: `.trainyard/` in the checkout this code runs from.
DEFAULT_HOME = Path(__file__).resolve().parents[1] / ".trainyard"
STACK_ENV_FILE = "stack.env"


def home_dir() -> Path:
    """The local stack's folder, whether a stack runs there now or not."""
    return Path(os.environ.get(HOME_VARIABLE, DEFAULT_HOME)).resolve()


def read_stack_env(home: Path | None = None) -> dict[str, str]:
    """The variables a running local stack wrote for clients (empty when none is running)."""
    path = (home or home_dir()) / STACK_ENV_FILE
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key.removeprefix("export ").strip(): value.strip() for key, value in pairs}


def write_stack_env(home: Path, env: Mapping[str, str]) -> None:
    """Record `env` as the running stack's variables in `home`, as `read_stack_env` reads them."""
    (home / STACK_ENV_FILE).write_text("".join(f"export {key}={value}\n" for key, value in env.items()))
