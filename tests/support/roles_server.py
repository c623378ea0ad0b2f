"""A NATS server of a test's own with a login per role, as `make up` runs it (devstack/natslogins.py),
how each role logs in to it, and a connection that keeps the server's refusals."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client

from devstack.natslogins import FOLDER, provision_nats_logins
from devstack.servers import free_port, nats_server_binary, start_nats
from libs.auth import issue_node_token, issue_token, new_secret
from libs.contracts.identity import Identity
from libs.messaging.connection import NatsLogin
from libs.natsroles import SERVICES, inbox_prefix


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
class RolesServer:
    """Such a server: its URL, the folder of its logins and the platform secret tokens are signed with."""

    url: str
    folder: Path
    secret: str

    def password(self, service: str) -> str:
        return (self.folder / f"{service}.password").read_text().strip()

    def issuer_seed(self) -> bytes:
        """The auth callout's key, as the services that answer it read it."""
        return (self.folder / "issuer.nk").read_bytes().strip()

    def login(self, role: str) -> NatsLogin:
        """How `role` logs in: a service by its password, an agent by its node credential, a person by her token."""
        if role in SERVICES:
            return NatsLogin(user=role, password=self.password(role), inbox=inbox_prefix(role))
        if role.startswith("agent-"):
            return NatsLogin.for_token(issue_node_token(self.secret, role.removeprefix("agent-")))
        return NatsLogin.for_token(issue_token(self.secret, Identity(user=role, projects=["default"], admin=False)))

    async def connect(self, login: NatsLogin) -> Conn:
        """A connection logged in with `login` that keeps what the server refuses it; the caller closes it."""
        conn = Conn(nc=Client())

        async def on_error(exc: Exception) -> None:
            conn.errors.append(str(exc))

        await conn.nc.connect(self.url, error_cb=on_error, allow_reconnect=False, **login.options())
        return conn


def logins_folder(home: Path) -> Path:
    return home / FOLDER


@contextlib.contextmanager
def serving_roles(home: Path) -> Iterator[RolesServer]:
    """A roles server made under `home`, with a platform secret of its own, while the block runs."""
    with roles_server(home) as url:
        yield RolesServer(url, logins_folder(home), new_secret())


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
