"""Where the servers are and how the platform is tuned, from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from libs.auth import read_secret


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


# Host paths the agents hide from jobs (SPEC L1), separated by `:`; the files named by
# TRAINYARD_AUTH_SECRET_FILE, TRAINYARD_TOKEN_FILE and TRAINYARD_NODE_TOKEN_FILE are hidden besides.
HIDDEN_PATHS_VARIABLE = "TRAINYARD_HIDDEN_PATHS"
# The node agent's credential (libs.auth.issue_node_token): a file (preferred) or the token itself.
NODE_TOKEN_FILE_VARIABLE = "TRAINYARD_NODE_TOKEN_FILE"
# Where the autoscaler's local provider keeps its instances (services/autoscaler/providers/local.py).
LOCAL_INSTANCES_VARIABLE = "TRAINYARD_LOCAL_INSTANCES"
NODE_TOKEN_VARIABLE = "TRAINYARD_NODE_TOKEN"
# A service's PostgreSQL password, in a file (the local stack's are in .trainyard/postgres-auth/): used with
# DATABASE_URL, over any password that URL holds.
DATABASE_PASSWORD_FILE_VARIABLE = "TRAINYARD_DATABASE_PASSWORD_FILE"
# The database credentials only the services get: never a node agent, the CLI or a job.
DATABASE_VARIABLES = ("DATABASE_URL", DATABASE_PASSWORD_FILE_VARIABLE, "PGPASSWORD", "PGPASSFILE")


def _hidden_paths() -> tuple[Path, ...]:
    named = [p for p in os.environ.get(HIDDEN_PATHS_VARIABLE, "").split(os.pathsep) if p.strip()]
    files = ("TRAINYARD_AUTH_SECRET_FILE", "TRAINYARD_TOKEN_FILE", NODE_TOKEN_FILE_VARIABLE)
    named += [os.environ[n] for n in files if os.environ.get(n)]
    return tuple(dict.fromkeys(Path(p.strip()).resolve() for p in named))


def _database_password() -> str | None:
    path = os.environ.get(DATABASE_PASSWORD_FILE_VARIABLE)
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise SystemExit(f"cannot read the database password: {DATABASE_PASSWORD_FILE_VARIABLE}={path}: "
                         f"{exc.strerror}; `make up` writes it under .trainyard/postgres-auth/") from None


@dataclass(frozen=True)
class Settings:
    """Read once at start-up; every process takes the same variables."""

    nats_url: str = field(default_factory=lambda: os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    database_url: str = field(
        default_factory=lambda: os.environ.get("DATABASE_URL", "postgresql://127.0.0.1:5432/trainyard")
    )
    # The password of DATABASE_URL's role, when it is not in the URL (TRAINYARD_DATABASE_PASSWORD_FILE).
    database_password: str | None = field(default_factory=_database_password)
    # Shared storage holding algorithms, datasets, models, volumes and outputs (SPEC L1).
    storage_root: Path = field(
        default_factory=lambda: Path(os.environ.get("TRAINYARD_STORAGE", ".trainyard/storage")).resolve()
    )
    cluster_config: Path = field(
        default_factory=lambda: Path(os.environ.get("TRAINYARD_CLUSTER", "deploy/local/cluster.yaml"))
    )
    heartbeat_seconds: float = field(default_factory=lambda: _float("TRAINYARD_HEARTBEAT_SECONDS", 2.0))
    node_lost_seconds: float = field(default_factory=lambda: _float("TRAINYARD_NODE_LOST_SECONDS", 10.0))
    stop_grace_seconds: float = field(default_factory=lambda: _float("TRAINYARD_STOP_GRACE_SECONDS", 10.0))
    # How long the launcher keeps asking an unreachable node to stop before it gives its processes up.
    stop_give_up_seconds: float = field(default_factory=lambda: _float("TRAINYARD_STOP_GIVE_UP_SECONDS", 60.0))
    # M7: where alert mail goes out (smtp://host:port; unset: alerts are published on NATS only), who
    # sends it, and the operators who get every alert besides the job's creator.
    smtp_url: str | None = field(default_factory=lambda: os.environ.get("TRAINYARD_SMTP_URL") or None)
    alert_from: str = field(default_factory=lambda: os.environ.get("TRAINYARD_ALERT_FROM", "trainyard@localhost"))
    alert_emails: tuple[str, ...] = field(default_factory=lambda: tuple(
        a.strip() for a in os.environ.get("TRAINYARD_ALERT_EMAILS", "").split(",") if a.strip()))
    # M2: how often the monitor patrols and agents probe their health (NICs, boards, runtime).
    health_probe_seconds: float = field(default_factory=lambda: _float("TRAINYARD_HEALTH_PROBE_SECONDS", 5.0))
    # The secret that signs identity tokens (libs.auth); services that answer users refuse to start without it.
    auth_secret: str | None = field(default_factory=lambda: read_secret(required=False))
    # What jobs must not see: the platform's state folder(s) and secret files (agents, bwrap backend).
    hidden_paths: tuple[Path, ...] = field(default_factory=_hidden_paths)

    def require_auth_secret(self) -> str:
        if not self.auth_secret:
            raise SystemExit("no token signing secret: set TRAINYARD_AUTH_SECRET or TRAINYARD_AUTH_SECRET_FILE "
                             "(`make up` creates one under .trainyard/)")
        return self.auth_secret
