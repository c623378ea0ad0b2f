"""How a command reaches the services.

Every command that talks to the services is written one way: an async function that takes the
connected client first, decorated with `connected`. Its input is checked by its parameters'
callbacks (client.cli.params) before this connects; then the client is opened, the command run and
the client closed, and a refusal or an unreachable stack becomes an error with a hint.

The client and asyncio are imported only when a command runs, not when the CLI starts.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Coroutine
from datetime import datetime
from functools import wraps
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

import typer

from client.cli.output import fail, print_field_errors

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from libs.contracts.operations.base import CommandError

Params = ParamSpec("Params")

# `trainyard at TIME VIEW`: the instant the view is asked about, None for now. Set by the group's callback, and
# taken (so cleared) by the command that connects; every command line starts without it (the app's callback).
viewing_at: datetime | None = None

UNAUTHENTICATED_HINT = "set TRAINYARD_TOKEN (or TRAINYARD_TOKEN_FILE) to a token from `trainyard admin token`"
# NATS itself cannot be reached.
STACK_HINT = "is the stack running? start it with `make up`, or set NATS_URL"

# What to do next when the service's refusal carries no hint of its own.
DEFAULT_HINTS: dict[str, str] = {
    "not-found": "`trainyard search` lists the jobs you can see; nothing was changed",
    "forbidden": "ask an administrator, or the job's creator to share it with your project (J2 access)",
    "over-cap": "lower one of your urgent jobs first (`trainyard priority JOB normal`), or wait for one to end",
    "invalid-state": "`trainyard show JOB` shows the job's state; nothing was changed",
    "conflict": "`trainyard show JOB` shows the job as it is now; nothing was changed",
    "invalid-request": "`trainyard COMMAND --help` lists the accepted values",
    "invalid-spec": "fix the fields named above and try again",
    "unavailable": "try again in a few seconds; `make status` shows whether every process of a local stack runs",
    "internal": "see the service's log (.trainyard/logs/ for a local stack) and try again",
}


def error_hint(error: CommandError) -> str | None:
    """The next step for a refused request: the service's own hint, else one chosen by its code."""
    if error.code == "unauthenticated":
        return UNAUTHENTICATED_HINT
    return error.hint or DEFAULT_HINTS.get(error.code)


def answering_service(subject: str) -> str | None:
    """The service that answers requests on `subject` (the operation catalogue), if any."""
    from libs.contracts.operations.catalogue import BY_SUBJECT

    operation = BY_SUBJECT.get(subject)
    return operation.answered_by if operation is not None else None


def _unanswered(exc: BaseException) -> BaseException | None:
    """The error that names the subject nothing answered: `exc`, or the one it was raised in place of."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(getattr(seen, "subject", None), str):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def unavailable_hint(exc: BaseException) -> str:
    """What to do when nothing answers: name the service that does not, where to look, and for a job
    that may have been created all the same, how to find out."""
    unanswered = _unanswered(exc)
    if unanswered is None:  # NATS itself cannot be reached
        return STACK_HINT
    subject: str = getattr(unanswered, "subject", "")
    service = answering_service(subject)
    logs = _local_logs()
    if service is None:
        hint = f"nothing answers {subject}: `make status` shows which processes run; their logs are in {logs}"
    else:
        hint = (f"the {service} does not answer ({subject}): `make status` shows whether it runs; "
                f"its log is {logs}/{service}.log")
    job_id = getattr(exc, "job_id", None)
    if isinstance(job_id, str):
        hint += f"; job {job_id} may have been created all the same: `trainyard show {job_id}` tells"
    return hint


def _local_logs() -> str:
    """The local stack's log folder, relative to the working directory when under it."""
    from pathlib import Path

    from client.config import local_stack_logs

    logs = local_stack_logs()
    try:
        return str(logs.relative_to(Path.cwd()))
    except ValueError:
        return str(logs)


def connected(command: Callable[Concatenate[TrainyardClient, Params], Coroutine[Any, Any, None]],
              ) -> Callable[Params, None]:
    """A typer command from an async one that takes a connected client first."""

    @wraps(command)
    def run(*args: Params.args, **kwargs: Params.kwargs) -> None:
        _run_with_client(lambda client: command(client, *args, **kwargs))

    _hide_client_parameter(run, command)
    return run


def _hide_client_parameter(run: Callable[..., None], command: Callable[..., Any]) -> None:
    """typer builds a command's options from its signature: give `run` the command's parameters less
    the client, their annotations resolved (they are strings here, and the client's type is not
    imported at start-up)."""
    signature = inspect.signature(command)
    client_parameter, *parameters = signature.parameters.values()
    run.__annotations__ = {name: annotation for name, annotation in command.__annotations__.items()
                           if name != client_parameter.name}
    run.__annotations__ = typing.get_type_hints(run, include_extras=True)  # resolved in the command's module
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[parameter.replace(annotation=run.__annotations__[parameter.name]) for parameter in parameters])


def with_client(action: Callable[[TrainyardClient], Coroutine[Any, Any, None]]) -> None:
    """Run `action` with a connected client, as a command made by `connected` runs (for a command group's
    own callback, which typer calls with its context)."""
    _run_with_client(action)


def _run_with_client(action: Callable[[TrainyardClient], Coroutine[Any, Any, None]]) -> None:
    import asyncio

    from client.api import TrainyardError
    from libs.messaging.rpc import ServiceUnavailable

    global viewing_at
    at, viewing_at = viewing_at, None

    async def main() -> None:
        client = await _client_type().open()
        client.at = at
        try:
            await action(client)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    except TrainyardError as exc:
        print_field_errors(exc.error.errors)
        raise fail(exc.error.message if not exc.error.errors else "the request was refused",
                   error_hint(exc.error)) from None
    except ServiceUnavailable as exc:
        raise fail(str(exc), unavailable_hint(exc)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _client_type() -> type[TrainyardClient]:
    """The client class, looked up where the package exports it when a command runs: imported only
    then, and replaceable there (the CLI's tests stand in a fake)."""
    from client import cli

    return cli.TrainyardClient
