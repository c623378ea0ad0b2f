"""What a passing outage looks like: PostgreSQL or NATS away for a while.

Every process outlives them: a follower retries the message, a service loop starts again after a
pause, a request gets an honest `unavailable` reply. Anything else is a bug or bad input, and is
treated as such by the caller.
"""

from __future__ import annotations

import asyncpg
import nats.errors
import nats.js.errors

# Errors of a database or NATS that is away for a while.
OUTAGES: tuple[type[BaseException], ...] = (
    OSError,  # connection refused or reset, and TimeoutError (nats.errors.TimeoutError too)
    asyncpg.exceptions.InterfaceError,  # connection closed or released under the caller
    asyncpg.exceptions.PostgresConnectionError,  # ConnectionDoesNotExistError, ConnectionFailureError
    asyncpg.exceptions.OperatorInterventionError,  # CannotConnectNowError, AdminShutdownError
    asyncpg.exceptions.InsufficientResourcesError,  # TooManyConnectionsError, disk full
    asyncpg.exceptions.TransactionRollbackError,  # serialization failure, deadlock: try again
    # A pooled connection the server dropped in the middle of an operation can be handed out again before
    # the pool notices; asyncpg then refuses the next operation with "cannot switch to state ...; another
    # operation is in progress". Seen when PostgreSQL is killed under a running scheduler.
    asyncpg.exceptions.InternalClientError,
    nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError, nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError, nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError,
    nats.errors.NoRespondersError, nats.errors.FlushTimeoutError,
    nats.js.errors.ServiceUnavailableError,  # JetStream not answering (yet): a server starting, or short of quorum
)


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the database or NATS is away (try again later), rather than that something
    is wrong with what was asked."""
    return isinstance(error, OUTAGES)

