"""The cluster as people see it: nodes, resources, flavors, settings, storage access, identity and component marks.

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.cluster import NodeInfo, Resources
from libs.contracts.identity import Identity
from libs.contracts.jobspec import Access, ResourceName
from libs.contracts.operations.base import Done, PastInstant, ReplyMessage, RequestMessage, people_operation
from libs.contracts.scheduling import (
    AdminSettings,
    BoardDemand,
    FlavorInfo,
    NodeResources,
    StoredAccess,
    StoredKind,
)


class ListNodes(RequestMessage, frozen=True, tag="ListNodes.v1"):
    at: PastInstant | None = None


class NodeView(Struct, frozen=True, kw_only=True):
    info: NodeInfo
    # draining: the autoscaler is releasing it (A3); disk-full: its disk is under pressure (D1), see `problems`
    status: Literal["ready", "lost", "unhealthy", "draining", "disk-full"]
    used: Resources
    jobs: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)  # M2: why it is unhealthy


class NodeList(ReplyMessage, frozen=True, tag="NodeList.v1"):
    nodes: list[NodeView]


class GetResources(RequestMessage, frozen=True, tag="GetResources.v1"):
    """S7: the schedulable nodes for these flavors, with what is used and free on each."""

    flavors: list[str]
    at: PastInstant | None = None


class ResourceList(ReplyMessage, frozen=True, tag="ResourceList.v1"):
    nodes: list[NodeResources]


class ListFlavors(RequestMessage, frozen=True, tag="ListFlavors.v1"):
    """S8: flavors, optionally of one accelerator board model, with the boards queued jobs need."""

    board: str | None = None


class FlavorList(ReplyMessage, frozen=True, tag="FlavorList.v1"):
    flavors: list[FlavorInfo]
    demand: list[BoardDemand]


class MarkComponent(RequestMessage, frozen=True, tag="MarkComponent.v1"):
    """M2 drills: an administrator marks a node's component (`board:0`, `nic:eth0`, `runtime:storage`)
    faulty, or clears the mark with `faulty: false`."""

    node: str
    component: str
    faulty: bool = True
    reason: str = ""


class GetSettings(RequestMessage, frozen=True, tag="GetSettings.v1"):
    pass


class ChangeSettings(RequestMessage, frozen=True, tag="ChangeSettings.v1"):
    """Administrators only: replace the given settings, keep the others."""

    urgent_cap: int | None = None
    sharing_enabled: bool | None = None
    max_resumes_cap: int | None = None
    max_graceful_shutdown_seconds: int | None = None
    debug_retention: str | None = None
    cache_retention: str | None = None
    job_retention: str | None = None
    cache_high_percent: Annotated[float, Meta(gt=0, le=100)] | None = None
    cache_low_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    disk_high_percent: Annotated[float, Meta(gt=0, le=100)] | None = None
    disk_low_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    max_queued_jobs_per_user: int | None = None  # 0: no limit
    submit_rate: int | None = None  # jobs per second; 0: no limit
    submit_burst: Annotated[int, Meta(ge=1)] | None = None


class SettingsView(ReplyMessage, frozen=True, tag="SettingsView.v1"):
    settings: AdminSettings


class WhoAmI(RequestMessage, frozen=True, tag="WhoAmI.v1"):
    pass


class IdentityView(ReplyMessage, frozen=True, tag="IdentityView.v1"):
    identity: Identity


class SetStorageAccess(RequestMessage, frozen=True, tag="SetStorageAccess.v1"):
    """J2: register a resource of shared storage to the caller (or, for administrators, to `owner`),
    or change what the other members of `project` may do with it. Only its owner or an administrator
    may change a registered resource."""

    kind: StoredKind
    name: ResourceName
    project: ResourceName
    others: Access
    owner: str | None = None


class ListStorageAccess(RequestMessage, frozen=True, tag="ListStorageAccess.v1"):
    kind: StoredKind | None = None


class StorageAccessList(ReplyMessage, frozen=True, tag="StorageAccessList.v1"):
    """Registered resources of shared storage; whichever is not listed is open to everyone."""

    entries: list[StoredAccess]


# --- operations ------------------------------------------------------------------------------------

LIST_NODES = people_operation(
    "list-nodes", "trainyard.query.nodes.list", ListNodes, NodeList, "scheduler", changes_state=False,
    summary="The cluster's nodes and what runs on them.")
GET_RESOURCES = people_operation(
    "get-resources", "trainyard.query.resources", GetResources, ResourceList, "scheduler", changes_state=False,
    summary="Free and used resources of nodes, by flavor.")
LIST_FLAVORS = people_operation(
    "list-flavors", "trainyard.query.flavors", ListFlavors, FlavorList, "scheduler", changes_state=False,
    summary="The node flavors and the boards they carry.")
GET_SETTINGS = people_operation(
    "get-settings", "trainyard.query.settings", GetSettings, SettingsView, "scheduler", changes_state=False,
    summary="The administrators' settings.")
CHANGE_SETTINGS = people_operation(
    "change-settings", "trainyard.cmd.settings", ChangeSettings, SettingsView, "scheduler", changes_state=True,
    summary="Change the administrators' settings (administrators).")
WHOAMI = people_operation(
    "whoami", "trainyard.query.whoami", WhoAmI, IdentityView, "scheduler", changes_state=False,
    summary="Who the caller's token says they are.")
MARK_COMPONENT = people_operation(
    "mark-component", "trainyard.cmd.nodes.mark", MarkComponent, Done, "monitor", changes_state=True,
    summary="Mark a node's component faulty or sound (administrators).")
SET_STORAGE_ACCESS = people_operation(
    "set-storage-access", "trainyard.cmd.storage.access", SetStorageAccess, StorageAccessList, "scheduler",
    changes_state=True,
    summary="Set who may use a folder of shared storage.")
LIST_STORAGE_ACCESS = people_operation(
    "list-storage-access", "trainyard.query.storage.access", ListStorageAccess, StorageAccessList, "scheduler",
    changes_state=False,
    summary="Who may use the folders of shared storage.")
