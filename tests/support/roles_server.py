"""A NATS server of a test's own with a login per role, as `make up` runs it (libs/devstack/natslogins.py)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client

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


@dataclass
class Conn:
    """A connection to such a server, with the errors the server reported to it (its refusals)."""

    nc: Client
    errors: list[str] = field(default_factory=list)

    async def refused(self, operation: str, subject: str, wait: float = 30) -> bool:
        """Whether the server reported a permission violation for `operation` on `subject` within `wait` seconds."""
        wanted = f"permissions violation for {operation} to \"{subject}\"".lower()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                while not any(wanted in error.lower() for error in self.errors):
                    await asyncio.sleep(0.05)
        return any(wanted in error.lower() for error in self.errors)
