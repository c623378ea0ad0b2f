"""Identifiers that are safe in NATS subjects and file paths."""

from __future__ import annotations

import re
import secrets

JOB_ID = re.compile(r"^job-[0-9a-f]{12}\Z")


def new_job_id() -> str:
    """A random job id such as `job-3f9a1c0b7d2e` (48 random bits)."""
    return f"job-{secrets.token_hex(6)}"


def is_job_id(text: str) -> bool:
    return bool(JOB_ID.match(text))
