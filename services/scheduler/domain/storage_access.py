"""J2: a job's access for others never exceeds its creator's own access to the resources it uses.

Resources of shared storage (algorithms, datasets, annotation datasets, models, volumes, output
locations) may be registered to an owner with an access for the other members of a project
(`StoredAccess`, events `StorageAccessSet`). A user's own access to a resource is:

- read-write for a resource nobody registered (shared storage has no owners of its own), for its
  owner and for administrators;
- the registration's `others` for the other members of its project (none once an administrator
  switches sharing off);
- none for everyone else.

A job is refused when its creator may not use a resource the way the job mounts it (read-only
mounts need read-only access, writable ones read-write), or when the job's `access` grants the other
members of its project more than the creator's own access to any resource it uses: sharing a job
must not pass on more of its resources than its creator has. This is checked when a job is created
(submitted or cloned); a later change of a registration leaves existing jobs as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.contracts.identity import Identity
from libs.contracts.jobspec import Access, FieldError, JobSpec
from libs.contracts.scheduling import STORAGE_FOLDERS, StoredAccess, StoredKind
from libs.storage import job_storage

RANK: dict[Access, int] = {"none": 0, "read-only": 1, "read-write": 2}
KIND_OF_FOLDER: dict[str, StoredKind] = {folder: kind for kind, folder in STORAGE_FOLDERS.items()}
StorageCatalog = Mapping[tuple[str, str], StoredAccess]  # (kind, name) -> registration


@dataclass(frozen=True)
class ResourceUse:
    """One resource a job mounts, and from which spec field."""

    field: str
    kind: StoredKind
    name: str
    writes: bool


def resource_uses(spec: JobSpec) -> list[ResourceUse]:
    """Every resource of shared storage the job mounts on any node (each field once)."""
    uses: list[ResourceUse] = []
    for ref in job_storage(spec):
        folder, _, rest = ref.mount.source.partition("/")
        if (kind := KIND_OF_FOLDER.get(folder)) is not None:
            uses.append(ResourceUse(ref.field, kind, rest.split("/")[0], not ref.mount.read_only))
    return uses


def own_access(entry: StoredAccess | None, identity: Identity, *, sharing_enabled: bool) -> Access:
    """What `identity` may do with a resource registered as `entry` (None: not registered)."""
    if entry is None or identity.admin or entry.owner == identity.user:
        return "read-write"
    if not sharing_enabled or entry.project not in identity.projects:
        return "none"
    return entry.others


def storage_errors(spec: JobSpec, identity: Identity, catalog: StorageCatalog, *,
                   sharing_enabled: bool) -> list[FieldError]:
    """Why `identity` may not create a job of `spec` with the resources it uses (empty: it may)."""
    errors: list[FieldError] = []
    least: tuple[Access, ResourceUse] | None = None
    for use in resource_uses(spec):
        entry = catalog.get((use.kind, use.name))
        level = own_access(entry, identity, sharing_enabled=sharing_enabled)
        owner = f" (owned by {entry.owner})" if entry is not None else ""
        if level == "none":
            errors.append(FieldError(field=use.field, message=f"you have no access to {use.kind} {use.name!r}{owner}",
                                     hint="ask its owner to share it with your project, or choose another"))
            continue
        if use.writes and level == "read-only":
            hint = ("mount it read-only (read_only: true)" if use.kind in ("algorithm", "dataset", "annotation-dataset")
                    else f"choose a{'n' if use.kind == 'output' else ''} {use.kind} of your own")
            errors.append(FieldError(field=use.field, message=f"you may only read {use.kind} {use.name!r}{owner}",
                                     hint=hint))
            continue
        if least is None or RANK[level] < RANK[least[0]]:
            least = (level, use)
    if not errors and least is not None and RANK[spec.access] > RANK[least[0]]:
        level, use = least
        choices = " or ".join(a for a in ("read-only", "none") if RANK[a] <= RANK[level])
        errors.append(FieldError(field="access",
                                 message=f"is {spec.access}, more than your own access to {use.kind} {use.name!r} "
                                 f"({level})", hint=f"choose {choices}"))
    return errors
