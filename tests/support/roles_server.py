"""A NATS server of a test's own with a login per role, as `make up` runs it (libs/devstack/natslogins.py)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from libs.devstack.natslogins import provision_nats_logins
from libs.devstack.servers import free_port, nats_server_binary, start_nats


@contextlib.contextmanager
def roles_server(home: Path) -> Iterator[str]:
    """Its URL; the logins are made under `home`. The configuration is checked by nats-server first."""
    config = provision_nats_logins(home)
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr + check.stdout
    port = free_port()
    process = start_nats(home / "data", port, config=config)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)
