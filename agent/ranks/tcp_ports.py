"""Rendezvous ports chosen on the node (ReservePorts): a job's master port and TensorFlow task ports are
ports free here, never a fixed 29500 that another process may hold.

A port is given to a job attempt when nothing listens on it (a bind test) and no other reservation on the
host holds it. Reservations are held host-wide by a lock on a file per port in a folder every agent of the
host shares (`TRAINYARD_PORT_CLAIMS`), so agents that share a host (a test stack, a development machine)
never give one port to two jobs; a lock dies with the agent that held it, so nothing stale is left behind.
Asked again for the same attempt, the book answers the same ports: the launcher asks until it hears back.

A reservation lasts while the attempt has processes on the node, or HOLD_SECONDS after it was made when
it has none yet (the launch may still be planned and started). Ports are taken in turn through the range,
so a port just given up (perhaps in TIME_WAIT) is not the next one handed out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from libs.telemetry.logs import get_logger

log = get_logger(__name__)

RANGE_VARIABLE = "TRAINYARD_JOB_PORTS"
CLAIMS_VARIABLE = "TRAINYARD_PORT_CLAIMS"
DEFAULT_RANGE = (29500, 32767)  # below Linux's ephemeral range (32768-60999): no outgoing connection takes them
HOLD_SECONDS = 120.0

Attempt = tuple[str, int]  # (job id, attempt)


class PortRangeError(ValueError):
    """TRAINYARD_JOB_PORTS is not a range of ports."""


def parse_range(text: str) -> tuple[int, int]:
    """`low-high`, both between 1024 and 65535."""
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise PortRangeError(f"{RANGE_VARIABLE}={text!r} is not a port range such as 29500-32767") from None
    if not 1024 <= low <= high <= 65535:
        raise PortRangeError(f"{RANGE_VARIABLE}={text!r}: ports must be between 1024 and 65535, low to high")
    return low, high


def listening_is_possible(port: int) -> bool:
    """Whether a job could listen on `port` on every address now (nothing holds it, not even in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class HostClaim:
    """One port held for this agent across the host: a lock on `<claims>/<port>`, released on close."""

    def __init__(self, fd: int, port: int) -> None:
        self.fd, self.port = fd, port

    @classmethod
    def take(cls, claims: Path, port: int) -> HostClaim | None:
        fd = os.open(claims / str(port), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # another reservation on this host holds it
        return cls(fd, port)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)  # closing the last descriptor drops the lock


@dataclass
class Reservation:
    claims: list[HostClaim]
    until: float  # held at least until then, and as long as the attempt has processes on the node

    @property
    def ports(self) -> list[int]:
        return [claim.port for claim in self.claims]


@dataclass
class PortBook:
    low: int
    high: int
    claims: Path
    hold_seconds: float = HOLD_SECONDS
    free: Callable[[int], bool] = listening_is_possible
    reservations: dict[Attempt, Reservation] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        self.claims.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._next = self.low

    @classmethod
    def from_environment(cls) -> PortBook:
        low, high = parse_range(os.environ.get(RANGE_VARIABLE) or "-".join(map(str, DEFAULT_RANGE)))
        default_claims = Path(tempfile.gettempdir()) / f"trainyard-port-claims-{os.getuid()}"
        return cls(low, high, Path(os.environ.get(CLAIMS_VARIABLE) or default_claims))

    def reserve(self, attempt: Attempt, count: int, now: float, live: Collection[Attempt]) -> list[int] | None:
        """`count` ports for `attempt` (its earlier answer when it has one); None when the range has too few
        free."""
        self.release_unused(now, live)
        known = self.reservations.get(attempt)
        if known is not None and len(known.claims) == count:
            known.until = max(known.until, now + self.hold_seconds)
            return known.ports
        if known is not None:  # asked for another number: a new plan of the same attempt cannot be
            self._drop(attempt)
        claims = self._claim(count)
        if claims is None:
            return None
        self.reservations[attempt] = Reservation(claims, now + self.hold_seconds)
        return [claim.port for claim in claims]

    def hold(self, attempt: Attempt, ports: Collection[int], now: float) -> None:
        """Hold `ports` for an attempt this agent runs without having reserved them (started before a restart
        of the agent, or by an older launcher): best effort, as a process may already listen on them."""
        known = self.reservations.setdefault(attempt, Reservation([], now + self.hold_seconds))
        for port in set(ports) - set(known.ports):
            if self.low <= port <= self.high and (claim := HostClaim.take(self.claims, port)) is not None:
                known.claims.append(claim)

    def release_unused(self, now: float, live: Collection[Attempt]) -> None:
        """Give up the reservations of attempts without processes here once their hold time is over."""
        for attempt, reservation in list(self.reservations.items()):
            if attempt not in live and now >= reservation.until:
                self._drop(attempt)

    def close(self) -> None:
        for attempt in list(self.reservations):
            self._drop(attempt)

    def _drop(self, attempt: Attempt) -> None:
        for claim in self.reservations.pop(attempt).claims:
            claim.release()

    def _claim(self, count: int) -> list[HostClaim] | None:
        held = {port for reservation in self.reservations.values() for port in reservation.ports}
        size = self.high - self.low + 1
        claims: list[HostClaim] = []
        for step in range(size):
            port = self.low + (self._next - self.low + step) % size
            if port in held:
                continue
            claim = HostClaim.take(self.claims, port)
            if claim is None:
                continue
            if not self.free(port):
                claim.release()
                continue
            claims.append(claim)
            if len(claims) == count:
                self._next = self.low + (port - self.low + 1) % size
                return claims
        for claim in claims:
            claim.release()
        log.warning("agent.no_free_ports", low=self.low, high=self.high, wanted=count)
        return None
