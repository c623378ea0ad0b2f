"""A PostgreSQL server of the test's own (the local stack's binaries), to crash and start again."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from libs.devstack.servers import free_port, start_postgres, stop_postgres


@contextmanager
def private_postgres(home: Path) -> Iterator[tuple[Path, int]]:
    """A server under `home/postgres` on a free port: (its folder, its port); stopped at the end."""
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
