"""Training images (SPEC J10): the catalogue of images jobs may run in, and how one reaches shared storage.

An administrator registers an image archive (an OCI archive, a `docker save` archive, or a root-filesystem
tarball) under `NAME:TAG`, with the boards it is built for and whether it is marked for training jobs. The
archive goes to the scheduler in chunks (`UploadImageChunk`), each an ordinary authenticated request, and
then `RegisterImage` names the upload and its digest: the scheduler checks both and keeps the archive in
shared storage under its digest (`image_archive`), where every node reads it. A job names its image in
its spec (`image: NAME:TAG`); the scheduler refuses it unless the image is registered, marked for training
and built for the board of each of the job's flavors, and records what the name meant then (`ImageUse`) with
the job, so that every attempt of the job runs the same image whatever the catalogue says later.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from msgspec import Meta, Struct

# Names as container registries spell them (lower case, path components), tags as they allow them.
IMAGE_NAME = r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*\Z"
IMAGE_TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z"
BOARD = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z"
DIGEST = r"^sha256:[0-9a-f]{64}\Z"
UPLOAD_ID = r"^[0-9a-f]{32}\Z"

ImageName = Annotated[str, Meta(pattern=IMAGE_NAME, max_length=128, description=(
    "lower-case letters and digits, '.', '_', '-' between them, '/' between parts"))]
ImageTag = Annotated[str, Meta(pattern=IMAGE_TAG, description="letters, digits, '_', '.', '-' (at most 128)")]
BoardName = Annotated[str, Meta(pattern=BOARD, description="a board type such as sim-a100, mlu370 or cpu")]
Digest = Annotated[str, Meta(pattern=DIGEST, description="sha256:<64 hex digits>")]
UploadId = Annotated[str, Meta(pattern=UPLOAD_ID, description="32 hex digits, chosen by the client")]
ImageFormat = Literal["oci-archive", "docker-archive", "rootfs"]

CPU_BOARD = "cpu"  # the board of a flavor without accelerators
DEFAULT_TAG = "latest"
# One chunk of an upload: with base64 in a JSON request it stays well under the request limit (1 MiB).
MAX_CHUNK_BYTES = 512 * 1024
MAX_DESCRIPTION = 1000
IMAGES_FOLDER = "images"  # in shared storage


class ImageRefError(ValueError):
    """An image reference that is not NAME[:TAG]."""


def parse_image_ref(ref: str) -> tuple[str, str]:
    """`NAME[:TAG]` as (name, tag); the tag is `latest` when left out."""
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", DEFAULT_TAG)
    if not re.fullmatch(IMAGE_NAME, name) or len(name) > 128:
        raise ImageRefError(f"{ref!r} is not an image reference: the name must be lower-case letters and digits, "
                            "with '.', '_' or '-' between them and '/' between parts (e.g. pytorch/cpu:2.13)")
    if not re.fullmatch(IMAGE_TAG, tag):
        raise ImageRefError(f"{ref!r} has no valid tag: a tag is letters, digits, '_', '.' or '-' (e.g. :2.13)")
    return name, tag


def image_ref(name: str, tag: str) -> str:
    return f"{name}:{tag}"


def flavor_board(board: str | None) -> str:
    """The board type a flavor is for, as images name it: its accelerator board, or `cpu`."""
    return board or CPU_BOARD


def image_archive(digest: str) -> str:
    """Where an image's archive lies in shared storage (named by content: two tags of one archive share it)."""
    return f"{IMAGES_FOLDER}/blobs/{digest.removeprefix('sha256:')}.tar"


def upload_path(upload_id: str) -> str:
    """Where an upload under way is written in shared storage."""
    return f"{IMAGES_FOLDER}/uploads/{upload_id}.part"


class ImageRecord(Struct, frozen=True, kw_only=True):
    """One image of the catalogue."""

    name: str
    tag: str
    digest: str
    format: ImageFormat
    size_bytes: int
    boards: list[str]
    training: bool  # marked for training jobs (J10: only those may run them)
    description: str = ""
    registered_by: str
    registered_at: datetime

    @property
    def ref(self) -> str:
        return image_ref(self.name, self.tag)

    @property
    def archive(self) -> str:
        return image_archive(self.digest)


class ImageUse(Struct, frozen=True, kw_only=True):
    """The image a job runs in, as the catalogue named it when the job was accepted."""

    ref: str
    digest: str
    format: ImageFormat

    @property
    def archive(self) -> str:
        return image_archive(self.digest)


def use_of(record: ImageRecord) -> ImageUse:
    return ImageUse(ref=record.ref, digest=record.digest, format=record.format)
