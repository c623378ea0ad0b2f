"""Log metrics from inside a Trainyard job into its one run, shared by every process of the job (SPEC R1).

    from trainyard import run
    run.log({"loss": 0.31, "acc": 0.90}, step=120)
    run.config({"lr": 3e-4, "batch": 256})
    run.summary({"best_acc": 0.93})
    run.finish()  # optional: this process logs no more (the run goes on until rank 0 ends)

Any process of the job may log: each rank, each worker process it forks, a helper. Points go to the
node's agent over the local socket named by TRAINYARD_RUN_SOCKET, from a thread of their own: `log` never
waits for the agent. Each process numbers its lines; the agent acknowledges what it has published, and
what it has not acknowledged is sent again after a lost connection (the agent restarted), so nothing is
lost or stored twice. While the agent is away up to MAX_PENDING lines are kept; older ones are dropped and
counted (`run.dropped`). Outside a Trainyard job (no socket named), logging does nothing.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime

SOCKET_VARIABLE = "TRAINYARD_RUN_SOCKET"
PROCESS_VARIABLE = "TRAINYARD_RUN_PROCESS"  # a label for this process (default: pid-<pid>)
MAX_PENDING = 100_000
MAX_VALUES_PER_LINE = 256  # as libs/contracts/runs.py takes them
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:-]{0,127}$")
LABEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RETRY_SECONDS = 0.5
DROPPED_SERIES = "trainyard/dropped_lines"  # a process's count of dropped lines, logged once it reconnects


class Run:
    def __init__(self, path: str | None = None, process: str | None = None) -> None:
        self._path = path
        self._label = process
        self._pid = -1
        self._reset()

    def _reset(self) -> None:
        """Fresh state for this process (also in a child forked from a process that logged)."""
        self._pid = os.getpid()
        self.process = self._label or os.environ.get(PROCESS_VARIABLE) or f"pid-{self._pid}"
        if not LABEL.match(self.process):
            raise ValueError(f"{self.process!r} is not a process label: letters, digits, _ . - (at most 64)")
        self.path = self._path or os.environ.get(SOCKET_VARIABLE)
        self.dropped = 0  # lines dropped while the agent was away longer than MAX_PENDING lines
        self._dropped_reported = 0
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, bytes]] = deque()
        self._seq = 0
        self._acked = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- what a job calls -----------------------------------------------------------------------------

    def log(self, values: Mapping[str, float], step: int | None = None) -> None:
        """Log scalars (name -> number) at `step` (optional, >= 0)."""
        clean: dict[str, float] = {}
        for name, value in values.items():
            if not NAME.match(name):
                raise ValueError(f"{name!r} is not a metric name: letters, digits, _ . / : - (at most 128)")
            number = float(value)
            if math.isfinite(number):  # NaN and infinities are not stored
                clean[name] = number
        if step is not None and (not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a whole number >= 0, not {step!r}")
        items, at = list(clean.items()), _now()
        for start in range(0, len(items), MAX_VALUES_PER_LINE):  # a line holds at most so many
            self._send({"type": "log", "values": dict(items[start:start + MAX_VALUES_PER_LINE]), "step": step,
                        "at": at})

    def config(self, values: Mapping[str, object]) -> None:
        """Set values of the run's configuration (numbers, booleans, short strings)."""
        self._set("config", values)

    def summary(self, values: Mapping[str, object]) -> None:
        """Set values of the run's summary (the final or best figures)."""
        self._set("summary", values)

    def _set(self, what: str, values: Mapping[str, object]) -> None:
        items = list(_scalars(values).items())
        for start in range(0, len(items), MAX_VALUES_PER_LINE):
            self._send({"type": "set", "what": what, "values": dict(items[start:start + MAX_VALUES_PER_LINE])})

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the agent has every line logged so far; whether it has."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._acked >= self._seq:
                    return True
            self._wake.set()
            time.sleep(0.02)
        return False

    def finish(self, timeout: float = 10.0) -> bool:
        """This process logs no more: its end is recorded, then it stops sending. The run goes on: only its
        primary (rank 0's end, or the job's) finishes it, whichever process calls this."""
        self._send({"type": "end", "at": _now()})
        return self.close(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Flush, then stop sending (what is logged after is dropped); whether everything was taken."""
        taken = self.flush(timeout)
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        return taken

    # --- sending ----------------------------------------------------------------------------------------

    def _send(self, line: dict[str, object], trim: bool = True) -> None:
        if os.getpid() != self._pid:  # forked: this process logs as itself
            self._reset()
        if not self.path or self._closed:
            return
        with self._lock:
            self._seq += 1
            line.update(process=self.process, seq=self._seq)
            self._pending.append((self._seq, (json.dumps(line, separators=(",", ":")) + "\n").encode()))
            while trim and len(self._pending) > MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_forever, name="trainyard-run", daemon=True)
                self._thread.start()
        self._wake.set()

    def _send_forever(self) -> None:
        connection: socket.socket | None = None
        sent = 0
        buffered = b""
        while not self._closed:
            if connection is None:
                try:
                    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    connection.connect(self.path or "")
                except OSError:
                    connection = None
                    time.sleep(RETRY_SECONDS)
                    continue
                with self._lock:
                    sent = self._acked  # everything not acknowledged is sent again
                buffered = b""
                if self.dropped > self._dropped_reported:  # the run shows what this process lost
                    self._dropped_reported = self.dropped
                    self._send({"type": "log", "values": {DROPPED_SERIES: float(self.dropped)}, "step": None,
                                "at": _now()}, trim=False)  # not at the cost of another line
            with self._lock:
                lines = [(seq, data) for seq, data in self._pending if seq > sent]
            try:
                if lines:
                    connection.sendall(b"".join(data for _, data in lines))
                    sent = lines[-1][0]
                readable, _, _ = select.select([connection], [], [], 0.1)
                if readable:
                    data = connection.recv(65536)
                    if not data:
                        raise OSError("the agent closed the connection")
                    buffered = self._take_acks(buffered + data)
            except OSError:
                connection.close()
                connection = None
                continue
            if not lines and not readable:
                self._wake.wait(0.2)
                self._wake.clear()
        if connection is not None:
            connection.close()

    def _take_acks(self, data: bytes) -> bytes:
        *complete, rest = data.split(b"\n")
        for raw in complete:
            try:
                ack = json.loads(raw)
            except ValueError:
                continue
            if ack.get("type") == "ack" and ack.get("process") == self.process:
                with self._lock:
                    self._acked = max(self._acked, int(ack["seq"]))
                    while self._pending and self._pending[0][0] <= self._acked:
                        self._pending.popleft()
        return rest


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _scalars(values: Mapping[str, object]) -> dict[str, object]:
    clean: dict[str, object] = {}
    for name, value in values.items():
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not a name: letters, digits, _ . / : - (at most 128)")
        if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 1024):
            clean[name] = value
        else:
            clean[name] = str(value)[:1024]
    return clean


run = Run()


def _flush_at_exit() -> None:
    if run.path and run._thread is not None and not run.flush(timeout=5.0):
        print(f"trainyard.run: {run._seq - run._acked} line(s) not taken by the agent", file=sys.stderr)


atexit.register(_flush_at_exit)
