"""L1: which Unix user a job's processes run as on its nodes (cluster config `job_users`).

A pure choice, made by the launcher for each node of a plan (NodeLaunch.run_as) and, for a plan of a launcher
before it, by the agent alike: a hash of the job's id (one user per job) or of its creator's name (one per user)
into the configured range, so that every node of a job agrees without asking anyone.
"""

from __future__ import annotations

import hashlib

from libs.contracts.cluster import JobUsers


def job_uid(settings: JobUsers, job_id: str, creator: str) -> int:
    """The user (and group) id the job's processes run as."""
    key = f"user:{creator}" if settings.per == "user" else f"job:{job_id}"
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return settings.uid_base + digest % settings.uid_count


def unnamed_plan_uid(job_id: str) -> int:
    """The user a job ran as under a plan that names none (a launcher's from before users were chosen): its own, as
    that launcher's default chose; the plan does not name the job's creator."""
    return job_uid(JobUsers(per="job"), job_id, "")
