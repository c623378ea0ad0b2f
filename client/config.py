"""Where the client finds NATS, its token, the signing secret and the local stack's logs.

Variables come first; then what a local stack started with `make up` wrote for clients (`stack.env` in its
folder, libs/localstack.py); then the defaults. Nothing here connects, and it imports only the standard library
and libs/localstack.py, so reading the configuration adds nothing to the CLI's start-up.
"""

from __future__ import annotations

import os
from pathlib import Path

from libs.localstack import home_dir, read_stack_env


def default_nats_url() -> str:
    """NATS_URL, else the URL a local stack started with `make up` wrote, else the NATS default."""
    return os.environ.get("NATS_URL") or read_stack_env().get("NATS_URL") or "nats://127.0.0.1:4222"


def default_token() -> str | None:
    """TRAINYARD_TOKEN, else the file TRAINYARD_TOKEN_FILE names, else the token a local stack started
    with `make up` issued to its user, else ~/.config/trainyard/token."""
    if token := os.environ.get("TRAINYARD_TOKEN"):
        return token.strip()
    candidates = [os.environ.get("TRAINYARD_TOKEN_FILE"), read_stack_env().get("TRAINYARD_TOKEN_FILE"),
                  str(Path.home() / ".config" / "trainyard" / "token")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate).read_text().strip()
    return None


def local_stack_secret_file() -> str | None:
    """The file of the signing secret a running local stack recorded (TRAINYARD_AUTH_SECRET_FILE in stack.env),
    if one runs."""
    return read_stack_env().get("TRAINYARD_AUTH_SECRET_FILE")


def local_stack_logs() -> Path:
    """The local stack's log folder, whether a stack runs now or not."""
    return home_dir() / "logs"
