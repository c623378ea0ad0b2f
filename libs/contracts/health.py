"""Node health, pre-checks and checkpoints (SPEC M1–M4, J12): what agents probe and jobs are told.

A node's health is a list of components, each healthy or not: its NICs (link state from the
kernel), its accelerator boards (`nvidia-smi` where present), and its runtime environment (shared
storage reachable and writable, free disk for workspaces, free memory). Agents send them with every
heartbeat and answer pre-check requests with a fresh probe; an administrator can also mark a
component faulty (for drills and tests) until the mark is cleared.
"""

from __future__ import annotations

import re
from typing import Literal

from msgspec import Struct

ComponentKind = Literal["nic", "board", "runtime"]
COMPONENT_KINDS: tuple[ComponentKind, ...] = ("nic", "board", "runtime")
# A component as named in commands and events: `<kind>:<name>`, e.g. `board:0`, `nic:eth0`, `runtime:storage`.
COMPONENT_PATTERN = re.compile(r"^(nic|board|runtime):[A-Za-z0-9_.@-]{1,64}\Z")


class ComponentHealth(Struct, frozen=True, kw_only=True):
    kind: ComponentKind
    name: str
    healthy: bool
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"

    def __str__(self) -> str:
        state = "healthy" if self.healthy else "faulty"
        return f"{self.key} {state}" + (f" ({self.detail})" if self.detail else "")


class NodeCheck(Struct, frozen=True, kw_only=True):
    """M1: the pre-check of one candidate node for one job."""

    node: str
    passed: bool
    checks: list[ComponentHealth]

    def problems(self) -> list[str]:
        return [str(c) for c in self.checks if not c.healthy]


# J12: how a checkpoint-resume job is told to save. Every process of the job that handles this
# signal receives it; the job then has its graceful shutdown time before it is killed. Jobs read
# the signal's name and the (shared, per-job) checkpoint folder from the environment.
CHECKPOINT_SIGNAL = "SIGUSR1"
CHECKPOINT_DIR = "/workspace/checkpoints"
CHECKPOINT_SIGNAL_VARIABLE = "TRAINYARD_CHECKPOINT_SIGNAL"
CHECKPOINT_DIR_VARIABLE = "TRAINYARD_CHECKPOINT_DIR"
RESUME_COUNT_VARIABLE = "TRAINYARD_RESUME_COUNT"

# M6: the line jobs print once per iteration, as the platform document gives it.
PERFORMANCE_LINE = re.compile(
    r"this iteration hardware time is\s+(?P<hardware>[0-9]+(?:\.[0-9]+)?)\s+and e2e time is\s+"
    r"(?P<e2e>[0-9]+(?:\.[0-9]+)?)\s*ms"
)

AlertKind = Literal["node-unhealthy", "node-lost", "job-resuming", "resume-limit", "performance",
                    "precheck-failed", "message-set-aside", "instance-boot-timeout", "provisioning-failing"]
