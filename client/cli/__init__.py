"""`trainyard`: the command-line tool, a thin layer over `client.api.TrainyardClient` (SPEC X6).

The commands live in `commands/`, one module per group (jobs, scheduling, cluster, exec, storage, images,
admin); what they show is built by `render` and written by `output`. Starting the CLI imports typer, the contracts
and these modules only: the client (NATS, asyncio), rich, YAML and PyJWT are imported by the
commands that use them, so `trainyard --help` and a query's start-up stay short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from client.cli import runner
from client.cli.commands import (
    admin,
    autoscaler,
    cache,
    cluster,
    execute,
    images,
    jobs,
    metrics,
    past,
    scheduling,
    simulate,
    storage,
    tensorboard,
)
from client.cli.commands.jobs import follow_job
from client.cli.overrides import OverrideError, parse_set_options, read_overrides_file
from client.cli.render import clock_time, local_time, prediction_sentence, relative_time, resource_row, why_lines
from client.cli.runner import error_hint

if TYPE_CHECKING:
    from client.api import TrainyardClient

# What callers import from here: the app, `main`, `follow_job` (the local stack's demo), the client class
# the commands connect with, and the parsers and renderers that are checked without a stack.
__all__ = ["OverrideError", "TrainyardClient", "app", "clock_time", "error_hint", "follow_job", "local_time", "main",
           "parse_set_options", "prediction_sentence", "read_overrides_file", "relative_time", "resource_row",
           "why_lines"]

app = typer.Typer(help="Trainyard: queue, launch and follow distributed training jobs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _each_command_line() -> None:
    runner.viewing_at = None  # about now, unless `at TIME` says otherwise


app.add_typer(jobs.commands)
app.add_typer(scheduling.commands)
app.add_typer(simulate.commands)
app.add_typer(cluster.commands)
app.add_typer(execute.commands)
app.add_typer(autoscaler.commands)
app.add_typer(cache.commands)
app.add_typer(images.commands)
app.add_typer(metrics.commands)
app.add_typer(tensorboard.commands)
app.add_typer(admin.commands, name="admin")
app.add_typer(storage.commands, name="storage")
# A time ago (-2h) is TIME, not an option.
app.add_typer(past.commands, name="at", context_settings={"ignore_unknown_options": True})

_time = local_time  # the earlier name of `local_time`, still used by callers


def __getattr__(name: str) -> Any:
    # The client class is imported when a command first connects (client.cli.runner looks it up here).
    if name == "TrainyardClient":
        from client.api import TrainyardClient

        return TrainyardClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    app()
