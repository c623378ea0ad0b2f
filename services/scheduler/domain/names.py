"""The scheduler's name and the aggregates it records to, for every module of it to import.

Its job events go to one aggregate per job (id = job id); the administrator settings and the
registrations of shared storage's resources (J2) each to a single aggregate.
"""

from __future__ import annotations

from libs.contracts.events import Event, JobEvent, NodeDrained
from libs.eventstore import NewEvent
from libs.natsroles import events_consumer

SERVICE = "scheduler"
JOB = "job"
ARRAY = "array"  # the scheduler's aggregate of an array (id = array id)

# What it reads of each upstream service's events: the monitor's nodes, pre-checks, incidents, kept environments
# and caches (not its runs nor alerts), the launcher's launches, the autoscaler's instances (not its packing).
UPSTREAM_AGGREGATES: dict[str, tuple[str, ...]] = {"monitor": ("node", "job", "cache"), "launcher": ("launch",),
                                                   "autoscaler": ("instance",)}

# Those of them whose id is a job's (the monitor's about a job, the launcher's launches): part of its history.
ABOUT_JOBS = ("job", "launch")


def upstream_consumer(upstream: str) -> str:
    """The name of its follower of `upstream`'s events (and of that follower's tracking row)."""
    return events_consumer(upstream)
SETTINGS = ("settings", "platform")
STORAGE = ("storage", "catalog")
IMAGES = ("images", "catalog")  # J10: the catalogue of training images


def job_change(event: JobEvent) -> NewEvent:
    """`event` recorded to its job's aggregate."""
    return NewEvent(JOB, event.job_id, event)


DRAIN = "drain"  # the drains the scheduler acknowledged: one aggregate per node (A3)


def drain_change(event: NodeDrained) -> NewEvent:
    return NewEvent(DRAIN, event.node_name, event)


def settings_change(event: Event) -> NewEvent:
    return NewEvent(*SETTINGS, event)


def storage_change(event: Event) -> NewEvent:
    return NewEvent(*STORAGE, event)


def image_change(event: Event) -> NewEvent:
    return NewEvent(*IMAGES, event)
