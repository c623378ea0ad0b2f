"""`trainyard image` (J10): the catalogue of training images. Administrators register, mark, unmark and delete
images; everyone lists them and looks at one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import print_json, print_table, say, stdout
from client.cli.params import JsonOption, refusing
from client.cli.runner import connected
from libs.contracts.images import ImageRecord, ImageRefError, parse_image_ref

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.progress import Progress, TaskID

    from client.api import TrainyardClient

commands = typer.Typer()
image_commands = typer.Typer(help="The catalogue of training images jobs run in (J10).", no_args_is_help=True)
commands.add_typer(image_commands, name="image")

IMAGE_COLUMNS = ("IMAGE", "BOARDS", "TRAINING", "FORMAT", "SIZE", "DIGEST", "DESCRIPTION")


def checked_ref(ref: str) -> str:
    try:
        parse_image_ref(ref)
    except ImageRefError as exc:
        raise typer.BadParameter(str(exc)) from None
    return ref


RefArgument = Annotated[str, typer.Argument(metavar="NAME[:TAG]", help="The image (the tag is latest if left out).",
                                            callback=refusing(checked_ref))]


def image_row(image: ImageRecord) -> list[str]:
    return [image.ref, ", ".join(image.boards), "yes" if image.training else "no", image.format,
            f"{image.size_bytes / 2**20:.1f} MiB", image.digest.removeprefix("sha256:")[:12], image.description]


def _show(images: list[ImageRecord], as_json: bool) -> None:
    if as_json:
        print_json(images)
    elif not images:
        say("no images are registered: jobs without an image run on their nodes' own files")
    else:
        print_table(IMAGE_COLUMNS, [image_row(image) for image in images])


def _bar_progress(bars: Progress, task: TaskID) -> Callable[[int, int], None]:
    """The upload's progress on its bar. What is sent first may be what an earlier, cut-off upload left with
    the scheduler: the bar starts there, and the speed counts only what is sent now."""
    started = False

    def update(sent: int, _total: int) -> None:
        nonlocal started
        if started:
            bars.update(task, completed=sent)
        else:
            bars.reset(task, completed=sent)
            started = True

    return update


@image_commands.command("register")
@connected
async def register(client: TrainyardClient, ref: RefArgument,
                   archive: Annotated[Path, typer.Option(
                       "--archive", "-a", exists=True, dir_okay=False, readable=True,
                       help="An OCI archive (podman save --format oci-archive, skopeo copy), a docker save archive, "
                       "or a root-filesystem tarball.")],
                   boards: Annotated[list[str], typer.Option(
                       "--board", "-b", help="A board type it is built for (repeatable), e.g. sim-a100, cpu.")],
                   description: Annotated[str, typer.Option(help="What it holds.")] = "",
                   training: Annotated[bool, typer.Option(help="Mark it for training jobs at once.")] = True,
                   replace: Annotated[bool, typer.Option(help="Give a registered NAME:TAG this archive.")] = False,
                   as_json: JsonOption = False) -> None:
    """Upload an image archive to shared storage and register it (administrators)."""
    total = archive.stat().st_size
    if sys.stdout.isatty() and not as_json:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        with Progress(TextColumn("uploading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=stdout()) as bars:
            task = bars.add_task("upload", total=total)
            image = await client.register_image(ref, archive, boards=boards, training=training,
                                                description=description, replace=replace,
                                                progress=_bar_progress(bars, task))
    else:
        image = await client.register_image(ref, archive, boards=boards, training=training,
                                            description=description, replace=replace)
    if as_json:
        print_json(image)
        return
    _show([image], as_json=False)
    if not image.training:
        say(f"not marked for training jobs yet: trainyard image mark {image.ref}")


@image_commands.command("list")
@connected
async def list_images(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """Every registered image."""
    _show(await client.images(), as_json)


@image_commands.command("show")
@connected
async def show(client: TrainyardClient, ref: RefArgument, as_json: JsonOption = False) -> None:
    """One image: its boards, mark, format, size, full digest and who registered it when."""
    [image] = await client.images(ref)
    if as_json:
        print_json(image)
        return
    print_table(("FIELD", "VALUE"), [
        ("image", image.ref), ("boards", ", ".join(image.boards)),
        ("training", "marked for training jobs" if image.training else "not marked (jobs may not use it)"),
        ("format", image.format), ("size", f"{image.size_bytes / 2**20:.1f} MiB"), ("digest", image.digest),
        ("archive", image.archive), ("registered", f"{image.registered_at:%Y-%m-%d %H:%M:%S} by {image.registered_by}"),
        ("description", image.description)])


@image_commands.command("mark")
@connected
async def mark(client: TrainyardClient, ref: RefArgument, as_json: JsonOption = False) -> None:
    """Mark an image for training jobs (administrators)."""
    _show([await client.mark_image(ref, training=True)], as_json)


@image_commands.command("unmark")
@connected
async def unmark(client: TrainyardClient, ref: RefArgument, as_json: JsonOption = False) -> None:
    """Take the training mark away: new jobs may not use the image; accepted ones keep it (administrators)."""
    _show([await client.mark_image(ref, training=False)], as_json)


@image_commands.command("delete")
@connected
async def delete(client: TrainyardClient, ref: RefArgument) -> None:
    """Take an image out of the catalogue (administrators); jobs accepted with it still run in it."""
    say(await client.delete_image(ref))

