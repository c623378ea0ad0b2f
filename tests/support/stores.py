"""The type of the integration tests' `make_store` fixture."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from libs.eventstore import EventStore

# Opens the migrated event store of the named service in the test's database.
StoreFactory = Callable[[str], Awaitable[EventStore]]
