"""J15: a failed job's environment kept on its nodes for the debug terminal, until its retention is over."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class KeptEnvironment:
    job_id: str
    attempt: int
    nodes: list[str]
    until: datetime
    released: bool = False
    trace: dict[str, str] = field(default_factory=dict)
