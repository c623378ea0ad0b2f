"""J2 in the cluster views: jobs a caller may not view are not named to them.

Nodes, resources, explanations, predictions and event histories mention other jobs (the jobs on a
node, the jobs ahead, the jobs a start waits for). Everywhere else a job the caller may not view
looks as if it did not exist; here it stays counted, but its id and name are replaced by
`HIDDEN_JOB`, so that nobody learns the ids or names of jobs not shared with them.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from libs.access import allowed
from libs.contracts.identity import Identity
from libs.contracts.operations.cluster import ResourceList
from services.scheduler.domain.state import SchedulerState

HIDDEN_JOB = "another user's job"
_JOB_ID = re.compile(r"job-[0-9a-f]{12}")
Reply = TypeVar("Reply", bound=msgspec.Struct)


def hide_jobs(reply: Reply, state: SchedulerState, identity: Identity) -> Reply:
    """`reply` with every id of a job the caller may not view, in any field or sentence, replaced."""
    text = msgspec.json.encode(reply).decode()
    hidden = {job_id for job_id in set(_JOB_ID.findall(text)) if not _visible(state, identity, job_id)}
    if not hidden:
        return reply
    masked = _JOB_ID.sub(lambda match: HIDDEN_JOB if match.group() in hidden else match.group(), text)
    return msgspec.json.decode(masked, type=type(reply))


def hide_applications(resources: ResourceList, state: SchedulerState, identity: Identity) -> ResourceList:
    """S7's usage entries name the application (the job's name): hidden for jobs the caller may not view."""
    nodes = [msgspec.structs.replace(node, usage=[
        usage if _visible(state, identity, usage.job_id)
        else msgspec.structs.replace(usage, application=HIDDEN_JOB, job_id=HIDDEN_JOB)
        for usage in node.usage]) for node in resources.nodes]
    return ResourceList(nodes=nodes)


def _visible(state: SchedulerState, identity: Identity, job_id: str) -> bool:
    job = state.jobs.get(job_id)
    if job is None:  # an id that is no job hides nothing
        return True
    # Deleted or not: a caller's own deleted job is still theirs where an older event names it.
    return allowed(identity, job.spec, job.creator, "view", sharing_enabled=state.settings.sharing_enabled)
