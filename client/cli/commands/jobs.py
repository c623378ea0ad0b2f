"""Job commands: submit, list, show, logs, events, wait, stop, delete, clone, devenv and search.

submit, list, show, stop and delete also take arrays (libs/contracts/arrays.py): many jobs made from one spec,
each an ordinary job, listed and shown as one object."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import typer

from client.cli.output import fail, note, print_json, print_log_lines, print_pairs, print_table, say
from client.cli.overrides import OverrideError, clone_overrides
from client.cli.params import (
    ArrayRequest,
    FollowOption,
    JobIdArgument,
    JsonOption,
    array_indices,
    array_request,
    job_and_array_ids,
    job_or_array_id,
    job_statuses,
    jobs_and_arrays,
    optional,
    read_spec,
    refusing,
    selected_indices,
    sweep_parameters,
)
from client.cli.render import (
    ARRAY_COLUMNS,
    EVENT_COLUMNS,
    INSTANCE_COLUMNS,
    JOB_COLUMNS,
    SEARCH_COLUMNS,
    STAGING_COLUMNS,
    array_detail_rows,
    array_job_columns,
    array_job_row,
    array_row,
    event_row,
    instance_row,
    job_detail_rows,
    job_rows,
    more_jobs_line,
    plural,
    search_cells,
    staging_rows,
    status_cell,
)
from client.cli.runner import connected, with_client
from libs.contracts.arrays import is_array_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from client.api import TrainyardClient
    from libs.contracts.jobspec import JobSpec
    from libs.contracts.operations.arrays import ArraySelection
    from libs.contracts.operations.jobs import JobView

commands = typer.Typer()

StatusOption = Annotated[list[str] | None, typer.Option("--status", "-s", help="Only these statuses (repeatable).",
                                                        callback=refusing(job_statuses))]
IdArgument = Annotated[str, typer.Argument(metavar="ID", help="A job id or an array id.",
                                           callback=refusing(job_or_array_id))]
IdsArgument = Annotated[list[str], typer.Argument(metavar="ID", help="Job ids and array ids.",
                                                  callback=refusing(job_and_array_ids))]
IndicesOption = Annotated[str | None, typer.Option(
    "--indices", metavar="EXPR", help="Only these indices of the array given, e.g. 3,5-7.",
    callback=refusing(optional(selected_indices)))]
SHOWN_ARRAY_JOBS = 50  # the jobs `show ARRAY` lists without --all


@commands.command()
def submit(file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).", exists=True, dir_okay=False)],
           set_: Annotated[list[str] | None, typer.Option(
               "--set", metavar="KEY=VALUE", help="Replace a field of the spec, the value read as YAML; a dotted path "
               "sets one entry of a field and keeps its others (env.SEED=7). Repeatable; later ones win.",
               callback=refusing(checked_set_options))] = None,
           array: Annotated[str | None, typer.Option(
               "--array", metavar="EXPR", help="Submit an array: a job per index, e.g. 0-999, 1-10:2 or 0,6,16-32; "
               "%N at the end lets at most N of them run at once.", callback=refusing(optional(array_indices)))] = None,
           sweep: Annotated[list[str] | None, typer.Option(
               "--sweep", metavar="NAME=V1,V2", help="Submit an array with a job per combination of the values of "
               "the sweep's parameters (repeatable).", callback=refusing(sweep_parameters))] = None,
           max_running: Annotated[int | None, typer.Option(
               "--max-running", min=1, help="At most this many of the array's jobs run at once.")] = None,
           follow: FollowOption = False,
           as_json: JsonOption = False) -> None:
    """Submit a job described in FILE, or an array of jobs made from it; its id is printed (to stderr) before it
    is sent."""
    # Options that do not go together are refused here, before connecting, so the error shows without a stack. The
    # spec is checked whole once its --set options are applied: a file may leave out what they fill in.
    spec = read_spec(file, checked_set_options(set_))
    request = array_request(array, sweep, max_running, follow=follow)
    if request is None:
        with_client(lambda client: send_job(client, spec, follow=follow, as_json=as_json))
    else:
        with_client(lambda client: send_array(client, spec, request, as_json=as_json))


async def send_job(client: TrainyardClient, spec: JobSpec, *, follow: bool, as_json: bool) -> None:
    from libs.contracts.ids import new_job_id

    job_id = new_job_id()  # chosen here, so a submission sent again after a lost answer creates one job
    note(f"submitting job {job_id}")
    accepted = await client.submit(spec, job_id=job_id, on_retry=sending_again(job_id))
    if as_json:
        print_json(accepted)
    else:
        say("submitted ", (accepted.job_id, "bold"), f" ({spec.name}): {accepted.status}")
    if follow:
        job = await follow_job(client, accepted.job_id)
        if job.status != "succeeded":
            raise typer.Exit(1)


async def send_array(client: TrainyardClient, spec: JobSpec, request: ArrayRequest, *, as_json: bool) -> None:
    from libs.contracts.arrays import new_array_id

    array_id = new_array_id()  # chosen here, as a job's id is: sent again, the array is still created once
    note(f"submitting array {array_id} ({plural(request.size, 'job')})")
    accepted = await client.submit_array(spec, indices=request.indices, sweep=request.sweep,
                                         max_running=request.max_running, array_id=array_id,
                                         on_retry=sending_again(array_id, "array"))
    if as_json:
        print_json(accepted)
    else:
        say("submitted array ", (accepted.array_id, "bold"), f" ({plural(len(accepted.job_ids), 'job')}): {spec.name}")


def sending_again(created_id: str, kind: str = "job") -> Callable[[int, Exception], None]:
    """What to say when a request creating job (or array) `created_id` went unanswered (or the scheduler could
    not serve it) and is sent again."""
    from client.api import CREATE_ATTEMPTS

    def retrying(attempt: int, error: Exception) -> None:
        note(f"{error}; sending {kind} {created_id} again (attempt {attempt} of {CREATE_ATTEMPTS})")

    return retrying


async def follow_job(client: TrainyardClient, job_id: str) -> JobView:
    """Print status changes and every node's log lines until the job ends."""
    import asyncio  # loaded already: this runs in the command's event loop

    last_status: list[str] = []

    def on_change(job: JobView) -> None:
        running = sum(i.state == "running" for i in job.instances)
        if job.status == "queued":
            detail = f" (position {job.queue_position})" if job.queue_position else ""
        elif job.status == "running" and last_status[-1:] != ["running"]:
            detail = " on " + ", ".join(f"rank {p.rank}@{p.node}" for p in job.placement)
        elif job.status == "running":
            detail = f": {running}/{len(job.instances)} instances running"
        else:
            detail = f": {job.reason}" if job.reason else ""
        last_status.append(job.status)
        say((datetime.now().strftime("%H:%M:%S"), "dim"), f" {job.job_id} ", status_cell(job.status), detail)

    async def print_logs() -> None:
        async for chunk in client.logs(job_id, follow=True):
            print_log_lines(chunk.rank, chunk.lines, prefix=True)

    log_task = asyncio.create_task(print_logs())
    job = await client.wait(job_id, on_change=on_change)
    await log_task
    return job


@commands.command("list")
@connected
async def list_jobs(client: TrainyardClient,
                    status: StatusOption = None,
                    project: Annotated[str | None, typer.Option(help="Only this project.")] = None,
                    show_all: Annotated[bool, typer.Option("--all", "-a", help="Also list worker instances "
                                                           "(rank > 0) of multi-node jobs, and every job of every "
                                                           "array.")] = False,
                    as_json: JsonOption = False) -> None:
    """List jobs and arrays, newest first: one row per job, its master instance (L8), and one per array."""
    from libs.contracts.operations.jobs import JobList

    if show_all:
        listing = JobList(jobs=await client.list_jobs(job_statuses(status), project))
    else:
        listing = await client.listing(job_statuses(status), project)
        listing = msgspec.structs.replace(listing, jobs=[
            msgspec.structs.replace(j, instances=[i for i in j.instances if i.rank == 0]) for j in listing.jobs])
    if as_json:
        print_json(listing)
        return
    if not listing.jobs and not listing.arrays:
        say("no jobs")
    if listing.jobs:
        expected = any(job.expected is not None for job in listing.jobs)  # S6, as `why` tells it
        columns = (*JOB_COLUMNS, "EXPECTED START") if expected else JOB_COLUMNS
        print_table(columns, [row for job in listing.jobs for row in job_rows(job, expected=expected)])
    if listing.arrays:
        print_table(ARRAY_COLUMNS, [array_row(array) for array in listing.arrays], title="arrays")


@commands.command()
def show(target: IdArgument,
         show_all: Annotated[bool, typer.Option("--all", "-a", help="An array's jobs, every one of them, not the "
                                                f"first {SHOWN_ARRAY_JOBS}.")] = False,
         as_json: JsonOption = False) -> None:
    """Show a job (its state, placement and per-node instances), or an array (its summary and its jobs)."""
    if is_array_id(target):
        with_client(lambda client: show_array(client, target, show_all=show_all, as_json=as_json))
        return
    if show_all:
        raise fail(f"--all lists every job of an array, and {target} is a job", "leave --all out: `trainyard show "
                   f"{target}` shows each of the job's instances")
    with_client(lambda client: show_job(client, target, as_json=as_json))


async def show_array(client: TrainyardClient, array_id: str, *, show_all: bool, as_json: bool) -> None:
    details = await client.get_array(array_id, limit=1 if show_all else SHOWN_ARRAY_JOBS)
    if show_all:
        jobs = [job async for job in client.array_jobs(array_id)]
        details = msgspec.structs.replace(details, jobs=jobs, more=False)
    if as_json:
        print_json(details)
        return
    print_pairs(array_detail_rows(details.array))
    if details.jobs:
        print_table(array_job_columns(details.array), [array_job_row(job, details.array) for job in details.jobs],
                    title="jobs")
    if details.more:
        note(more_jobs_line(details.array, len(details.jobs)))


async def show_job(client: TrainyardClient, job_id: str, *, as_json: bool) -> None:
    details = await client.get_job(job_id)
    # Resource samples and caches are kept as they are now, not as they were: a past view shows neither.
    now = client.at is None
    usage = {sample.rank: sample for sample in await client.usage(job_id)} if now else {}
    if as_json:
        print_json({**msgspec.to_builtins(details), "usage": msgspec.to_builtins(list(usage.values()))})
        return
    print_pairs(job_detail_rows(details))
    if details.job.instances:
        print_table(INSTANCE_COLUMNS, [instance_row(inst, usage.get(inst.rank)) for inst in details.job.instances],
                    title="instances")
    preparing = {inst.node for inst in details.job.instances if inst.state == "pending"}
    if now and details.spec.data_preparation and details.job.status == "running" and preparing:
        # J14: its nodes still copying its datasets, and how far they are.
        caches = [cache for cache in await client.cache() if cache.node in preparing]
        if rows := staging_rows(caches, details.spec):
            print_table(STAGING_COLUMNS, rows, title="data preparation")


@commands.command()
@connected
async def logs(client: TrainyardClient, job_id: JobIdArgument,
               node: Annotated[int | None, typer.Option("--node", "-n", help="Only this rank.")] = None,
               follow: FollowOption = False,
               raw: Annotated[bool, typer.Option(
                   "--raw", help="Print the lines exactly as the job wrote them: its escape sequences (colours, "
                   "cursor moves, carriage returns) act on this terminal instead of being shown as \\x1b and "
                   "the like.")] = False) -> None:
    """Print a job's logs: every node merged with rank prefixes, or one node."""
    await client.get_job(job_id)  # a clear error for an unknown job
    async for chunk in client.logs(job_id, node, follow=follow):
        print_log_lines(chunk.rank, chunk.lines, prefix=node is None, raw=raw)


@commands.command()
@connected
async def events(client: TrainyardClient, job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Print the full event history of a job across services."""
    history = await client.history(job_id)
    if not history:
        raise fail(f"no events for {job_id}", "check the id with `trainyard list`")
    if as_json:
        print_json(history)
        return
    print_table(EVENT_COLUMNS, [event_row(envelope) for envelope in history])


@commands.command()
@connected
async def wait(client: TrainyardClient, job_id: JobIdArgument,
               timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None) -> None:
    """Wait until a job ends; exit 0 only if it succeeded."""
    try:
        job = await client.wait(job_id, timeout=timeout)
    except TimeoutError as exc:
        raise fail(str(exc), "wait longer with --timeout, or drop it to wait until the job ends") from None
    say(f"{job.job_id} ", status_cell(job.status), f": {job.reason}" if job.reason else "")
    if job.status != "succeeded":
        raise typer.Exit(1)


@commands.command()
def stop(ids: IdsArgument, indices: IndicesOption = None) -> None:
    """Stop jobs, and the jobs of arrays (all, or those of --indices): queued ones leave the queue, running ones
    are terminated."""
    job_ids, arrays = jobs_and_arrays(ids, indices)
    with_client(lambda client: stop_jobs(client, job_ids, arrays))


async def stop_jobs(client: TrainyardClient, job_ids: list[str], arrays: list[ArraySelection]) -> None:
    done = await client.stop(job_ids, arrays=arrays)
    say(done.message)


@commands.command()
def delete(ids: IdsArgument, indices: IndicesOption = None) -> None:
    """Delete ended jobs, and the jobs of arrays (all, or those of --indices; stop running ones first)."""
    job_ids, arrays = jobs_and_arrays(ids, indices)
    with_client(lambda client: delete_jobs(client, job_ids, arrays))


async def delete_jobs(client: TrainyardClient, job_ids: list[str], arrays: list[ArraySelection]) -> None:
    done = await client.delete(job_ids, arrays=arrays)
    say(done.message)


def checked_overrides(file: Path | None, items: list[str] | None, name: str | None = None) -> dict[str, Any]:
    try:
        return clone_overrides(file, items or [], name)
    except OverrideError as exc:
        raise fail(str(exc), exc.hint) from None


def checked_set_options(items: list[str] | None) -> dict[str, Any]:
    return checked_overrides(None, items)


def checked_overrides_file(path: Path | None) -> dict[str, Any]:
    return checked_overrides(path, None)


@commands.command()
@connected
async def clone(client: TrainyardClient,
                job_id: Annotated[str, typer.Argument(help="The job to copy.")],
                set_: Annotated[list[str] | None, typer.Option(
                    "--set", metavar="KEY=VALUE", help="Replace a field of the spec, the value read as YAML; a dotted "
                    "path sets one entry of a field and keeps its others (env.SEED=7). Repeatable; later ones win.",
                    callback=refusing(checked_set_options))] = None,
                file: Annotated[Path | None, typer.Option(
                    "--file", "-f", help="YAML mapping of fields (or dotted paths into them) to replace.", exists=True,
                    dir_okay=False,
                    callback=refusing(checked_overrides_file))] = None,
                name: Annotated[str | None, typer.Option("--name", help="The new job's name.")] = None,
                as_json: JsonOption = False) -> None:
    """Create a job from another's spec, with fields replaced (O1); prints the new job's id, first to stderr."""
    from libs.contracts.ids import new_job_id

    new_id = new_job_id()  # chosen here, so a clone sent again after a lost answer creates one job
    note(f"cloning {job_id} as job {new_id}")
    accepted = await client.clone(job_id, checked_overrides(file, set_, name), job_id=new_id,
                                  on_retry=sending_again(new_id))
    if as_json:
        print_json(accepted)
        return
    say(f"cloned {job_id} as ", (accepted.job_id, "bold"), f": {accepted.status}")


@commands.command()
@connected
async def devenv(client: TrainyardClient, job_id: JobIdArgument,
                 output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the YAML to this file.",
                                                             dir_okay=False)] = None) -> None:
    """Print a development environment spec derived from a job (O4), as YAML."""
    spec = await client.devenv(job_id)
    document = msgspec.yaml.encode(spec).decode()
    if output is None:
        sys.stdout.write(document)
        return
    output.write_text(document)
    say(f"wrote the development environment of {job_id} to {output}")


@commands.command()
@connected
async def search(client: TrainyardClient,
                 name: Annotated[str | None, typer.Option(help="Part of the name (any case).")] = None,
                 status: StatusOption = None,
                 creator: Annotated[str | None, typer.Option(help="Created by this user.")] = None,
                 algorithm: Annotated[str | None, typer.Option(help="Runs this own algorithm.")] = None,
                 favorite_algorithm: Annotated[str | None, typer.Option(help="Runs this favourite algorithm.")] = None,
                 flavor: Annotated[str | None, typer.Option(help="Has this flavor among its flavors.")] = None,
                 output: Annotated[str | None, typer.Option(help="Writes to this output location.")] = None,
                 project: Annotated[str | None, typer.Option(help="In this project.")] = None,
                 limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many jobs.")] = 200,
                 offset: Annotated[int, typer.Option(min=0, max=1_000_000,
                                                     help="Skip this many of the newest first.")] = 0,
                 as_json: JsonOption = False) -> None:
    """Search the jobs you may see (O2), newest first; every filter given must match."""
    from libs.contracts.operations.jobs import SEARCH_JOBS, SearchJobs  # the reply, for how many match in all

    request = SearchJobs(name=name, statuses=job_statuses(status), creator=creator, algorithm=algorithm,
                         favorite_algorithm=favorite_algorithm, flavor=flavor, output=output, project=project,
                         limit=limit, offset=offset)
    page = await client.ask(SEARCH_JOBS, request)
    jobs = page.jobs
    if as_json:
        print_json(jobs)
        return
    if jobs:
        print_table(SEARCH_COLUMNS, [search_cells(job) for job in jobs])
    elif not offset or not page.total:
        say("no jobs match")
        return
    total = "?" if page.total is None else page.total  # a scheduler that does not count
    skipped = f", after the first {offset}" if offset else ""
    note(f"{len(jobs)} of {total} {'job' if total == 1 else 'jobs'}{skipped}")
