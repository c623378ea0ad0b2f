"""Where instances come from (SPEC A5): a provider starts an instance of a type, ends one, and lists the
ones it runs for Trainyard.

Starting is idempotent per instance name: asked again for a name it started (the autoscaler restarted
before it heard back), a provider answers the instance it has rather than starting another. Every call may
take long (an instance boots for minutes), so the autoscaler makes them outside its lock, in tasks of their
own, and never waits on one in its decision loop.
"""

from __future__ import annotations

from typing import Protocol

from libs.contracts.cluster import InstanceType


class ProvisionError(Exception):
    """The provider could not start the instance."""


class NoCapacity(ProvisionError):
    """The provider has no capacity (or no quota) for the type now: try another type, and this one later."""


class Provider(Protocol):
    async def launch(self, instance: str, kind: InstanceType, node_token: str) -> str:
        """Start `instance` of `kind`, whose agent logs in with `node_token`; its id at the provider."""
        ...

    async def terminate(self, instance: str) -> None:
        """End `instance` and what runs on it; nothing when it is gone already."""
        ...

    async def running(self) -> dict[str, str]:
        """The instances this provider runs for Trainyard: name -> id at the provider."""
        ...
