"""A PostgreSQL server of the test's own (the local stack's binaries), to crash and start again, and the kind of
cluster an earlier version of the stack left (every connection trusted)."""

from __future__ import annotations

import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from devstack.servers import as_server_user, free_port, hand_over, postgres_bin_dir, start_postgres, stop_postgres


@contextmanager
def server_folder() -> Iterator[Path]:
    """A temporary folder for a server outside pytest's: that one's parent is made private (0700) again by every
    pytest session that starts meanwhile, and the server's user, when the tests run as root, must reach in."""
    with tempfile.TemporaryDirectory(prefix="trainyard-pg-") as folder:
        yield Path(folder)


@contextmanager
def private_postgres(home: Path) -> Iterator[tuple[Path, int]]:
    """A server under `home/postgres` on a free port: (its folder, its port); stopped at the end. Its
    administrator's URL: `devstack.servers.admin_url(folder, port, database)`."""
    home.chmod(0o755)  # the server runs as an unprivileged user when the tests run as root
    folder, port = home / "postgres", free_port()
    start_postgres(folder, port)
    try:
        yield folder, port
    finally:
        stop_postgres(folder)


def crash_postgres(folder: Path) -> None:
    """kill -9 the server and every process of it, as a crash would end them."""
    server = psutil.Process(int((folder / "pgdata" / "postmaster.pid").read_text().splitlines()[0]))
    processes = [server, *server.children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=30)


@contextmanager
def trusting_postgres(folder: Path, port: int) -> Iterator[str]:
    """A cluster in `folder` as the stack made them before its passwords: initialised with `--auth=trust` and
    running on 127.0.0.1:`port`; yields the administrator's URL (no password), and stops it at the end."""
    bin_dir, cluster = postgres_bin_dir(), folder / "pgdata"
    folder.mkdir(parents=True, exist_ok=True)
    hand_over(folder)
    subprocess.run(as_server_user([str(bin_dir / "initdb"), "-D", str(cluster), "-U", "postgres", "--auth=trust",
                                   "-E", "UTF8", "--no-sync"]), check=True, stdout=subprocess.DEVNULL)
    subprocess.run(as_server_user([str(bin_dir / "pg_ctl"), "-D", str(cluster), "-o",
                                   f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off", "-l",
                                   str(folder / "postgres.log"), "-w", "start"]), check=True, stdout=subprocess.DEVNULL)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        stop_postgres(folder)
