"""Who is asking (SPEC J2): the authenticated caller of every command and query.

Clients send a signed token (see `libs.auth`) in the `Authorization` header of each request; the
services verify it and act for the identity it carries, never for a name the request claims.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from libs.contracts.jobspec import ResourceName

AUTH_HEADER = "Authorization"


class Identity(Struct, frozen=True, kw_only=True):
    """A user, the projects they belong to, and whether they administer the platform."""

    user: str
    projects: list[ResourceName] = msgspec.field(default_factory=list)
    admin: bool = False
    email: str | None = None  # where alerts about the user's jobs are mailed (M7)

    def member_of(self, project: str) -> bool:
        return self.admin or project in self.projects
