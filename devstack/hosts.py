"""Separate hosts on one machine: a network namespace per node agent, each with its own address on a bridge.

The control host (NATS, the services, PostgreSQL) is the machine's own namespace, reached at the bridge's address;
each node agent runs in a namespace of its own (`ip netns exec`), whose only interface is one end of a veth pair
plugged into the bridge, with its own address and the control host as its route out. So nothing crosses hosts
through 127.0.0.1: NATS listens on the bridge's address, agents and their jobs reach each other by their hosts'
addresses, and cutting a host's link (`cut`) cuts it off as a pulled cable would.

It needs iproute2 (`ip`) and the right to make namespaces and links (root, or CAP_NET_ADMIN); `unavailable()` says
why not where it cannot.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class HostsError(RuntimeError):
    """A namespace, link or address could not be made."""


def unavailable() -> str | None:
    """Why separate hosts cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (or CAP_NET_ADMIN)"
    probe = f"ty{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except HostsError as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    _ip("netns", "del", probe)
    return None


def _free_subnet() -> str:
    """A 10.77.x of its own: stacks made side by side (tests on several workers) must not share a /24."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    free = [f"10.77.{x}" for x in range(20, 220) if f" 10.77.{x}." not in shown]
    return secrets.choice(free) if free else f"10.77.{secrets.randbelow(200) + 20}"


@dataclass
class Hosts:
    """Hosts named `names` on a /24 of 10.77.x of their own: the control host at .1, host i at .(11 + i)."""

    names: list[str]
    tag: str = field(default_factory=lambda: secrets.token_hex(2))  # interface names stay within 15 characters
    subnet: str = field(default_factory=_free_subnet)
    made: bool = False

    @property
    def bridge(self) -> str:
        return f"ty{self.tag}br"

    @property
    def control(self) -> str:
        """The control host's address: where NATS listens and the services are."""
        return f"{self.subnet}.1"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{11 + self.names.index(host)}"

    def namespace(self, host: str) -> str:
        return f"ty{self.tag}-{host}"

    def link(self, host: str) -> str:
        """The control host's end of `host`'s cable."""
        return f"ty{self.tag}h{self.names.index(host)}"

    def prefix(self, host: str) -> list[str]:
        """What runs a command on `host`."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def create(self) -> None:
        """Make the bridge and every host; what was made is removed again when a step fails."""
        self.made = True
        try:
            self._create()
        except BaseException:
            self.delete()
            raise

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.control}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.names:
            namespace, link, inside = self.namespace(host), self.link(host), f"ty{self.tag}x"
            _ip("netns", "add", namespace)
            _ip("link", "add", link, "type", "veth", "peer", "name", inside)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("link", "set", inside, "netns", namespace)
            _ip("-n", namespace, "link", "set", inside, "name", "eth0")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "route", "add", "default", "via", self.control)

    def cut(self, host: str) -> None:
        """Pull `host`'s cable: nothing reaches it or leaves it until `mend`."""
        _ip("link", "set", self.link(host), "down")

    def mend(self, host: str) -> None:
        _ip("link", "set", self.link(host), "up")

    def delete(self) -> None:
        """Remove the namespaces (their ends of the cables go with them) and the bridge; what is gone already is
        passed over."""
        if not self.made:
            return
        for host in self.names:
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", self.link(host)], capture_output=True, check=False)  # both ends
        subprocess.run(["ip", "link", "del", f"ty{self.tag}x"], capture_output=True, check=False)  # one not moved yet
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        self.made = False
