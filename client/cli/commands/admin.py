"""`trainyard admin`: platform settings, fault drills, and user tokens and node credentials issued locally."""

from __future__ import annotations

import os
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from client.cli.output import fail, note, print_json, print_pairs, say
from client.cli.params import JsonOption, duration_seconds, refusing
from client.cli.render import settings_rows
from client.cli.runner import connected
from libs.contracts.health import COMPONENT_PATTERN
from libs.contracts.identity import Identity
from libs.contracts.jobspec import NODE_NAME

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer(help="Administrator commands: platform settings, user tokens, node credentials and fault "
                       "drills.",
                       no_args_is_help=True)

EMAIL_PATTERN = re.compile(r"[^@\s]+@[^@\s]+")
NO_SECRET_HINT = ("set TRAINYARD_AUTH_SECRET to the secret the services sign tokens with, or "
                  "TRAINYARD_AUTH_SECRET_FILE to the file that holds it (a local stack started with `make up` "
                  "records its file in .trainyard/stack.env)")


# --- settings -------------------------------------------------------------------------------------------------


def sharing_switch(sharing: str | None) -> bool | None:
    """--sharing on|off as a change of the setting, None when not given."""
    if sharing is None:
        return None
    if sharing.lower() not in ("on", "off"):
        raise fail(f"--sharing takes on or off, not {sharing!r}", "e.g. --sharing off")
    return sharing.lower() == "on"


def retention(text: str | None) -> int | None:
    return None if text is None else duration_seconds(text, "--debug-retention 4h")


@commands.command("settings")
@connected
async def admin_settings(
        client: TrainyardClient,
        urgent_cap: Annotated[int | None, typer.Option(min=0, help="Running + queued urgent jobs per user and "
                                                       "project (S2).")] = None,
        sharing: Annotated[str | None, typer.Option(metavar="on|off", callback=refusing(sharing_switch),
                                                    help="off forces every job's access for others to none (J2).")]
        = None,
        max_resumes_cap: Annotated[int | None, typer.Option(min=0, help="Cap on a job's maximum resumes (J12).")]
        = None,
        max_graceful_shutdown_seconds: Annotated[int | None, typer.Option(
            min=0, help="Cap on a job's graceful shutdown time (J12).")] = None,
        debug_retention: Annotated[str | None, typer.Option(callback=refusing(retention),
                                                            help="How long a failed job's environment is kept "
                                                            "(J15), e.g. 4h.")] = None,
        cache_retention: Annotated[str | None, typer.Option(callback=refusing(retention),
                                                            help="How long a node keeps a cached dataset no job "
                                                            "uses (D1), e.g. 7d.")] = None,
        cache_high: Annotated[float | None, typer.Option(min=0.1, max=100, help="Percent of a node's disk its "
                                                         "dataset cache may hold; above it the least recently "
                                                         "used entries go (D1).")] = None,
        cache_low: Annotated[float | None, typer.Option(min=0, max=100, help="Percent of the disk a cache is cut "
                                                        "down to once above --cache-high.")] = None,
        disk_high: Annotated[float | None, typer.Option(min=0.1, max=100, help="Percent full above which a node "
                                                        "takes no new work (D1).")] = None,
        disk_low: Annotated[float | None, typer.Option(min=0, max=100, help="Percent full at or below which such "
                                                       "a node takes work again.")] = None,
        max_queued_jobs: Annotated[int | None, typer.Option(min=0, help="Jobs one user may have queued, all "
                                                            "projects together; 0: no limit.")] = None,
        submit_rate: Annotated[int | None, typer.Option(min=0, help="Jobs per second one user's submissions "
                                                        "refill (an array of N counts N); 0: no limit.")] = None,
        submit_burst: Annotated[int | None, typer.Option(min=1, help="Jobs one user may submit at once, also the "
                                                         "largest array they may submit.")] = None,
        job_retention: Annotated[str | None, typer.Option(callback=refusing(retention),
                                                          help="How long an ended job stays in the services' "
                                                          "memory (at least 1m); `search` finds it ever after, "
                                                          "e.g. 7d.")] = None,
        as_json: JsonOption = False) -> None:
    """Show the platform settings; with options, change them (administrators only)."""
    sharing_enabled = sharing_switch(sharing)
    changes = (urgent_cap, sharing_enabled, max_resumes_cap, max_graceful_shutdown_seconds, debug_retention,
               cache_retention, cache_high, cache_low, disk_high, disk_low, max_queued_jobs, submit_rate,
               submit_burst, job_retention)
    changing = any(value is not None for value in changes)
    if changing:
        settings = await client.change_settings(
            urgent_cap=urgent_cap, sharing_enabled=sharing_enabled, max_resumes_cap=max_resumes_cap,
            max_graceful_shutdown_seconds=max_graceful_shutdown_seconds, debug_retention=debug_retention,
            cache_retention=cache_retention, cache_high_percent=cache_high, cache_low_percent=cache_low,
            disk_high_percent=disk_high, disk_low_percent=disk_low, max_queued_jobs_per_user=max_queued_jobs,
            submit_rate=submit_rate, submit_burst=submit_burst, job_retention=job_retention)
    else:
        settings = await client.settings()
    if as_json:
        print_json(settings)
        return
    if changing:
        say("settings changed")
    print_pairs(settings_rows(settings))


# --- fault drills ---------------------------------------------------------------------------------------------


def node_name(node: str) -> str:
    if not node.strip():
        raise fail("the node name is empty", "`trainyard nodes` lists the nodes")
    return node


def component_name(component: str) -> str:
    if not COMPONENT_PATTERN.match(component):
        raise fail(f"{component!r} is not a component name",
                   "write <kind>:<name> with kind nic, board or runtime, e.g. board:0, nic:eth0 or runtime:storage")
    return component


@commands.command("fault")
@connected
async def admin_fault(client: TrainyardClient,
                      node: Annotated[str, typer.Argument(help="The node's name.", callback=refusing(node_name))],
                      component: Annotated[str, typer.Argument(help="<kind>:<name>, e.g. board:0, nic:eth0, "
                                                               "runtime:storage.", callback=refusing(component_name))],
                      reason: Annotated[str, typer.Option(help="Why, recorded with the mark.")] = "",
                      clear: Annotated[bool, typer.Option("--clear", help="Clear the mark instead.")] = False) -> None:
    """Mark a node's component faulty, e.g. for a drill (M2), or clear the mark (administrators only).

    A marked node is unhealthy: nothing new is placed on it and its checkpoint-resume jobs are moved.
    """
    done = await client.mark_component(node, component, faulty=not clear, reason=reason)
    if done.message:
        say(done.message)
    elif clear:
        say(f"{node}: cleared the mark on {component}")
    else:
        say(f"{node}: {component} marked faulty; clear it with `trainyard admin fault {node} {component} --clear`")


# --- tokens: issued here with the platform's secret, no stack needed ------------------------------------------


def token_lifetime(ttl: str) -> int:
    return duration_seconds(ttl, "--ttl 30d")


def user_name(user: str) -> str:
    if not user.strip():
        raise fail("the user name is empty", "e.g. trainyard admin token alice --project vision")
    return user


def email_address(email: str | None) -> str | None:
    if email is not None and not EMAIL_PATTERN.fullmatch(email.strip()):
        raise fail(f"{email!r} is not an email address", "e.g. --email alice@example.com")
    return email


def signing_secret() -> str:
    """The platform secret: TRAINYARD_AUTH_SECRET(_FILE), else the file a running local stack recorded."""
    from libs.auth import read_secret

    try:
        secret = read_secret(required=False)
    except OSError as exc:
        raise fail(f"cannot read TRAINYARD_AUTH_SECRET_FILE ({exc})", NO_SECRET_HINT) from None
    if secret:
        return secret
    from client.config import local_stack_secret_file

    path = local_stack_secret_file()
    if path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as exc:
            raise fail(f"cannot read the local stack's secret file {path} ({exc})", NO_SECRET_HINT) from None
        if secret:
            return secret
    raise fail("no signing secret to issue the token with", NO_SECRET_HINT)


@commands.command("token")
def admin_token(user: Annotated[str, typer.Argument(help="The user the token speaks for.",
                                                    callback=refusing(user_name))],
                project: Annotated[list[str] | None, typer.Option("--project", "-p", help="A project the user "
                                                                  "belongs to (repeatable).")] = None,
                admin: Annotated[bool, typer.Option("--admin", help="Make the user an administrator.")] = False,
                email: Annotated[str | None, typer.Option(help="Where alerts about the user's jobs are mailed (M7).",
                                                          callback=refusing(email_address))] = None,
                ttl: Annotated[str, typer.Option(help="How long the token is valid: 90s, 30m, 4h, 2d.",
                                                 callback=refusing(token_lifetime))] = "30d",
                output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the token to this file "
                                                            "(readable by you only).", dir_okay=False)] = None) -> None:
    """Issue a signed token for a user, locally with the platform secret (no stack needed)."""
    from libs.auth import AuthError, issue_token  # PyJWT: only this command signs

    ttl_seconds = token_lifetime(ttl)
    try:
        identity = msgspec.convert({"user": user.strip(), "projects": project or [], "admin": admin,
                                    "email": email.strip() if email else None}, Identity)
    except msgspec.ValidationError as exc:
        raise fail(f"invalid project name ({exc})", "project names use letters, digits, '_', '.' and '-'") from None
    try:
        token = issue_token(signing_secret(), identity, ttl_seconds=ttl_seconds)
    except AuthError as exc:
        raise fail(str(exc), NO_SECRET_HINT) from None
    expires = (datetime.now(UTC) + timedelta(seconds=ttl_seconds)).strftime("%Y-%m-%d %H:%M UTC")
    who = (f"{identity.user}" + (f" <{identity.email}>" if identity.email else "")
           + f" (projects: {', '.join(identity.projects) or 'none'}"
           + ("; administrator" if identity.admin else "") + ")")
    if output is None:
        # Only the token on stdout, so that `export TRAINYARD_TOKEN=$(trainyard admin token ...)` works.
        sys.stdout.write(token + "\n")
        note(f"token for {who}, valid until {expires}; use it as TRAINYARD_TOKEN")
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    output.chmod(0o600)
    say(f"wrote a token for {who} to {output}, valid until {expires}; use it with TRAINYARD_TOKEN_FILE={output}")


def credential_node_name(node: str) -> str:
    if not re.fullmatch(NODE_NAME, node):
        raise fail(f"{node!r} is not a node name", "node names are lower-case DNS labels such as node-a, "
                   "as the agent's --name")
    return node


def write_private(path: Path, text: str) -> None:
    """Write a credential to a file only its owner may read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")
    path.chmod(0o600)


@commands.command("node-token")
def admin_node_token(node: Annotated[str, typer.Argument(help="The node the credential registers (the agent's "
                                                         "--name).", callback=refusing(credential_node_name))],
                     ttl: Annotated[str, typer.Option(help="How long the credential is valid: 90s, 30m, 4h, 2d.",
                                                      callback=refusing(token_lifetime))] = "365d",
                     output: Annotated[Path | None, typer.Option("--out", "--output", "-o", help="Write the "
                                                                 "credential to this file (readable by you only).",
                                                                 dir_okay=False)] = None) -> None:
    """Issue a node credential, locally with the platform secret: the monitor accepts the node's agent only with it."""
    from libs.auth import AuthError, issue_node_token  # PyJWT: only this command signs

    ttl_seconds = token_lifetime(ttl)
    try:
        token = issue_node_token(signing_secret(), node, ttl_seconds=ttl_seconds)
    except AuthError as exc:
        raise fail(str(exc), NO_SECRET_HINT) from None
    expires = (datetime.now(UTC) + timedelta(seconds=ttl_seconds)).strftime("%Y-%m-%d %H:%M UTC")
    if output is None:
        sys.stdout.write(token + "\n")
        note(f"node credential for {node}, valid until {expires}; give it to the agent in a file named by "
             "TRAINYARD_NODE_TOKEN_FILE (or in TRAINYARD_NODE_TOKEN)")
        return
    write_private(output, token)
    say(f"wrote a node credential for {node} to {output}, valid until {expires}; start the agent with "
        f"TRAINYARD_NODE_TOKEN_FILE={output}")
