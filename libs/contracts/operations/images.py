"""The catalogue of training images: uploading, registering, listing, marking and deleting them (SPEC J10).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from libs.contracts.images import (
    MAX_CHUNK_BYTES,
    MAX_DESCRIPTION,
    BoardName,
    Digest,
    ImageName,
    ImageRecord,
    ImageTag,
    UploadId,
)
from libs.contracts.operations.base import Done, ReplyMessage, RequestMessage, people_operation

# --- J10: training images (libs/contracts/images.py) -----------------------------------------------


class UploadImageChunk(RequestMessage, frozen=True, tag="UploadImageChunk.v1"):
    """A piece of an archive being uploaded (administrators). Chunks come in order: `offset` is where this
    one begins; a chunk sent again after its answer was lost is answered as the first time.

    An upload is its sender's: the same `upload_id` from another person names another upload. The client
    names an upload by its archive's digest, so that sending the same archive again goes on from what is
    held: a chunk without `data` at offset 0 asks how much that is, and sends nothing."""

    upload_id: UploadId
    offset: Annotated[int, Meta(ge=0)]
    data: Annotated[bytes, Meta(max_length=MAX_CHUNK_BYTES)]


class UploadReceived(ReplyMessage, frozen=True, tag="UploadReceived.v1"):
    upload_id: str
    received_bytes: int  # the upload's length so far: where the next chunk begins


class RegisterImage(RequestMessage, frozen=True, tag="RegisterImage.v1"):
    """Make an upload an image of the catalogue (administrators). `digest` is the whole archive's, as the
    client read it: an upload that differs is refused. `replace` gives an existing NAME:TAG a new archive."""

    name: ImageName
    tag: ImageTag
    upload_id: UploadId
    digest: Digest
    boards: Annotated[list[BoardName], Meta(min_length=1, max_length=64)]
    training: bool = True
    description: Annotated[str, Meta(max_length=MAX_DESCRIPTION)] = ""
    replace: bool = False


class ListImages(RequestMessage, frozen=True, tag="ListImages.v1"):
    """The catalogue (everyone); with `ref`, that one image."""

    ref: Annotated[str, Meta(max_length=300)] | None = None


class ImageList(ReplyMessage, frozen=True, tag="ImageList.v1"):
    images: list[ImageRecord] = msgspec.field(default_factory=list)


class MarkImage(RequestMessage, frozen=True, tag="MarkImage.v1"):
    """Mark an image for training jobs, or take the mark away (administrators)."""

    ref: Annotated[str, Meta(max_length=300)]
    training: bool


class DeleteImage(RequestMessage, frozen=True, tag="DeleteImage.v1"):
    """Take an image out of the catalogue (administrators). Jobs that were accepted with it keep it."""

    ref: Annotated[str, Meta(max_length=300)]


# --- operations ------------------------------------------------------------------------------------

UPLOAD_IMAGE = people_operation(
    "upload-image", "trainyard.cmd.images.upload", UploadImageChunk, UploadReceived, "scheduler", changes_state=True,
    summary="Send one chunk of an image archive.")
REGISTER_IMAGE = people_operation(
    "register-image", "trainyard.cmd.images.register", RegisterImage, ImageList, "scheduler", changes_state=True,
    summary="Add an uploaded image to the catalogue.")
LIST_IMAGES = people_operation(
    "list-images", "trainyard.query.images.list", ListImages, ImageList, "scheduler", changes_state=False,
    summary="The catalogue of training images.")
MARK_IMAGE = people_operation(
    "mark-image", "trainyard.cmd.images.mark", MarkImage, ImageList, "scheduler", changes_state=True,
    summary="Mark an image fit or unfit for training.")
DELETE_IMAGE = people_operation(
    "delete-image", "trainyard.cmd.images.delete", DeleteImage, Done, "scheduler", changes_state=True,
    summary="Remove an image from the catalogue.")
