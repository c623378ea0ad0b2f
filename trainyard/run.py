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
SEND_LINES = 2_000  # lines written to the agent at once
DROPPED_SERIES = "trainyard/dropped_lines"  # a process's count of dropped lines, logged as it grows


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
        self.dropped = 0  # lines never sent: over MAX_PENDING waited for the agent (away, or slower than the job)
        self._dropped_reported = 0
        self._reported_at = -1.0
        self._reports: set[int] = set()  # the line numbers of those counts, while not acknowledged
        self._lock = threading.Lock()
        self._unsent: deque[tuple[int, bytes]] = deque()  # logged, not sent on the current connection
        self._inflight: deque[tuple[int, bytes]] = deque()  # sent, not acknowledged yet: sent again if lost
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
        """Wait until the agent has taken every line kept so far; whether it has every line logged (none was
        dropped)."""
        deadline = time.monotonic() + timeout
        self._report_dropped(now=True)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._unsent and not self._inflight:
                    return self.dropped == 0
            self._wake.set()
            time.sleep(0.02)
        return False

    @property
    def waiting(self) -> int:
        """Lines logged and kept that the agent has not taken yet."""
        with self._lock:
            return len(self._unsent) + len(self._inflight)

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
        """Queue a line; `trim=False`: a count of dropped lines, which is not counted dropped itself."""
        if os.getpid() != self._pid:  # forked: this process logs as itself
            self._reset()
        if not self.path or self._closed:
            return
        with self._lock:
            self._seq += 1
            line.update(process=self.process, seq=self._seq)
            self._unsent.append((self._seq, (json.dumps(line, separators=(",", ":")) + "\n").encode()))
            if not trim:
                self._reports.add(self._seq)
            while trim and len(self._unsent) > MAX_PENDING:  # the oldest never sent goes: training never waits
                seq, _ = self._unsent.popleft()
                if seq in self._reports:  # a count of dropped lines is not one of the job's
                    self._reports.discard(seq)
                else:
                    self.dropped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_forever, name="trainyard-run", daemon=True)
                self._thread.start()
        self._wake.set()

    def _send_forever(self) -> None:
        connection: socket.socket | None = None
        buffered = b""
        while not self._closed:
            if connection is None:
                connection = self._connect()
                buffered = b""
                if connection is None:
                    time.sleep(RETRY_SECONDS)
                    continue
            self._report_dropped()
            with self._lock:  # the next lines, taken off the queue: `log` never waits on a scan of it
                room = MAX_PENDING - len(self._inflight)  # sent and unacknowledged lines stay bounded too
                lines = [self._unsent.popleft() for _ in range(min(room, SEND_LINES, len(self._unsent)))]
                self._inflight.extend(lines)
            try:
                if lines:
                    connection.sendall(b"".join(data for _, data in lines))
                readable, _, _ = select.select([connection], [], [], 0.1 if not lines else 0)
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

    def _connect(self) -> socket.socket | None:
        """A connection to the agent, with every line not acknowledged queued to be sent again first, and the
        count of lines dropped so far queued after them (for the run to show what this process lost)."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.path or "")
        except OSError:
            connection.close()
            return None
        with self._lock:
            self._unsent.extendleft(reversed(self._inflight))
            self._inflight.clear()
        self._report_dropped()
        return connection

    def _report_dropped(self, now: bool = False) -> None:
        """Log the count of lines dropped, when it grew (at most once a second, unless `now`), for the run to
        show what this process lost."""
        at = time.monotonic()
        if self.dropped > self._dropped_reported and (now or at - self._reported_at >= 1.0):
            self._dropped_reported, self._reported_at = self.dropped, at
            self._send({"type": "log", "values": {DROPPED_SERIES: float(self.dropped)}, "step": None, "at": _now()},
                       trim=False)  # not at the cost of another line

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
                    while self._inflight and self._inflight[0][0] <= self._acked:
                        self._reports.discard(self._inflight.popleft()[0])
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
        print(f"trainyard.run: {run.waiting} line(s) not taken by the agent, {run.dropped} dropped", file=sys.stderr)


atexit.register(_flush_at_exit)
