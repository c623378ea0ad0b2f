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
from functools import wraps
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

import typer

from client.cli.output import fail, print_field_errors

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from libs.contracts.messages import CommandError

Params = ParamSpec("Params")

UNAUTHENTICATED_HINT = "set TRAINYARD_TOKEN (or TRAINYARD_TOKEN_FILE) to a token from `trainyard admin token`"
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
    "unavailable": STACK_HINT,
    "internal": "see the service's log (.trainyard/logs/ for a local stack) and try again",
}


def error_hint(error: CommandError) -> str | None:
    """The next step for a refused request: the service's own hint, else one chosen by its code."""
    if error.code == "unauthenticated":
        return UNAUTHENTICATED_HINT
    return error.hint or DEFAULT_HINTS.get(error.code)


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


def _run_with_client(action: Callable[[TrainyardClient], Coroutine[Any, Any, None]]) -> None:
    import asyncio

    from client.api import TrainyardError
    from libs.messaging.rpc import ServiceUnavailable

    async def main() -> None:
        client = await _client_type().open()
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
        raise fail(str(exc), STACK_HINT) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _client_type() -> type[TrainyardClient]:
    """The client class, looked up where the package exports it when a command runs: imported only
    then, and replaceable there (the CLI's tests stand in a fake)."""
    from client import cli

    return cli.TrainyardClient
