"""The NATS logins of a stack: a password per service, the auth callout's issuer key, and the
nats-server configuration that enforces the roles (libs/natsroles.py, libs/natsauth.py).

Everything lives under `home/nats-auth/` (mode 0700, files 0600); like all of `home`, jobs never see
it. Node agents, people and jobs need nothing from here: they log in with their Trainyard token.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from libs.messaging.connection import NATS_PASSWORD_FILE_VARIABLE, NatsLogin
from libs.natsauth import ISSUER_SEED_FILE_VARIABLE, issuer_public_key, new_issuer_seed
from libs.natsroles import CALLOUT_SERVICES, SERVICES, callout_config, inbox_prefix

FOLDER = "nats-auth"
CONFIG = "nats-server.conf"


def _secret_file(path: Path, content: bytes) -> None:
    if not path.exists():
        path.touch(mode=0o600)
        path.write_bytes(content)


def provision_nats_logins(home: Path, *, sync_every_write: bool = False) -> Path:
    """Create (once) the service passwords and the issuer key; write the server configuration; return its path.

    JetStream hands every message to the operating system before it acknowledges it, and syncs it to disk
    first only with `sync_every_write` (as deploy/ runs it): the stack's own PostgreSQL does not fsync either,
    so both survive a crash of their own process, not of the machine (docs/local-stack.md)."""
    folder = home / FOLDER
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _secret_file(folder / "issuer.nk", new_issuer_seed())
    for service in SERVICES:
        _secret_file(folder / f"{service}.password", secrets.token_urlsafe(24).encode())
    credentials = {service: (folder / f"{service}.password").read_text().strip() for service in SERVICES}
    config = folder / CONFIG
    config.touch(mode=0o600)
    config.write_text(callout_config(credentials, issuer_public_key((folder / "issuer.nk").read_bytes().strip()),
                                     sync_every_write=sync_every_write))
    return config


def nats_login_env(home: Path, service: str) -> dict[str, str]:
    """Service `service`'s NATS password file and, for the services that answer the auth callout, the
    issuer key; nothing when the stack runs on a NATS server of its own choosing (no logins provisioned)."""
    folder = home / FOLDER
    password = folder / f"{service}.password"
    if not password.exists():
        return {}
    env = {NATS_PASSWORD_FILE_VARIABLE: str(password)}
    if service in CALLOUT_SERVICES:
        env[ISSUER_SEED_FILE_VARIABLE] = str(folder / "issuer.nk")
    return env


def service_login(home: Path, service: str) -> NatsLogin:
    """Service `service`'s login to the stack's NATS (its password from `home`), as the service itself logs in."""
    password = (home / FOLDER / f"{service}.password").read_text().strip()
    return NatsLogin(user=service, password=password, inbox=inbox_prefix(service))
