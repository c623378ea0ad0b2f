"""A nats-server of a test's own (`devstack.servers.start_nats`), which the test kills and starts again on the same
port and store: the machine's server is shared by every test and is never restarted."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from devstack.servers import free_port, start_nats


class OwnNats:
    def __init__(self, folder: Path, config: Path | None = None) -> None:
        """`config`: a nats-server configuration (the project's roles and login checking), else none."""
        self.folder, self.config, self.port = folder, config, free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = start_nats(self.folder, self.port, self.config)

    def kill(self) -> None:
        """Gone at once, as a crashed server is (nothing is flushed or said to the clients)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
