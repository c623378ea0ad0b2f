"""`trainyard exec`: a command, or a shell, in a job's kept (or running) node environment (J15)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, note
from client.cli.params import JobIdArgument
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()
PIPED_SHELL = "exec /bin/sh -s"


def command_words(ctx: typer.Context, words: list[str] | None) -> list[str] | None:
    """The words after --, refused when they make a blank command line (none at all: a shell)."""
    from client import terminal

    line = terminal.command_line(words or [])
    if line is not None and not line.strip():
        job_id = ctx.params.get("job_id", "JOB")
        raise fail("the command is empty", f"e.g. trainyard exec {job_id} -- ls /workspace, or leave it out for a "
                   "shell")
    return words


@commands.command("exec")
@connected
async def exec_in_job(client: TrainyardClient, job_id: JobIdArgument,
                      command: Annotated[list[str] | None, typer.Argument(
                          metavar="-- COMMAND", show_default=False, callback=command_words,
                          help="The command to run, after --; without one, an interactive shell.")] = None,
                      node: Annotated[str | None, typer.Option("--node", "-n", help="The node of the job to open it "
                                                               "on (default: the master's).")] = None) -> None:
    """Run a command, or open a shell, in a job's kept (or running) node environment (J15).

    Exits with the command's (or the shell's) exit code.
    """
    from client import terminal  # the session's terminal handling: only this command needs it

    line = terminal.command_line(command or [])
    stdin_tty = sys.stdin is not None and sys.stdin.isatty()
    if line is None and not stdin_tty:
        # No terminal to type at: a shell that reads its commands from what is piped (`< script.sh`, or
        # nothing from /dev/null) and ends at its end, as `ssh host < script` does.
        line = PIPED_SHELL
    interactive = line is None
    # A command's input is what is piped to it; typed at a terminal, it is closed (as with ssh host cmd).
    stdin = sys.stdin.buffer if sys.stdin is not None and (interactive or not stdin_tty) else None
    columns, rows = terminal.terminal_size()
    async with client.session(job_id, line, node=node, columns=columns, rows=rows) as session:
        if interactive:
            note(f"shell on {session.node} (rank {session.rank}, attempt {session.attempt}) of {job_id}; "
                 "type exit to leave")
        try:
            code = await terminal.attach(session, stdin=stdin, raw=interactive and stdin_tty)
        except ConnectionError as exc:
            raise fail(str(exc), f"`trainyard nodes` shows whether {session.node} still answers") from None
    raise typer.Exit(terminal.exit_status(code))
