"""`trainyard image`: the catalogue of training images (SPEC J10). Administrators upload, register, mark and
delete images; everyone lists them.

An archive arrives in chunks (`UploadImageChunk`, each an authenticated request of at most 512 KiB), appended
in order to `images/uploads/<upload>.part` in shared storage, where `<upload>` is made of the sender and the
upload id: an upload is its sender's, and the same id from someone else names another one. The client names
an upload by its archive's digest and asks first how much is held (a chunk without data), so an upload cut
off half-way goes on from there when the archive is sent again. `RegisterImage` then names the upload and
the digest the client read from its file: the scheduler reads the upload back, refuses it if the digest
differs or if it is no image archive it knows, moves it to `images/blobs/<digest>.tar` (where every node
reads it) and records `ImageRegistered`. Why not NATS's object store: it would let every person's connection
publish into JetStream (their role may not today), and a rollup header published there wipes the whole
bucket; these requests are checked one by one like every other command, administrators only.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from libs.contracts.events import ImageDeleted, ImageMarked, ImageRegistered
from libs.contracts.identity import Identity
from libs.contracts.images import ImageRecord, ImageRefError, image_archive, image_ref, upload_path
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.images import (
    DELETE_IMAGE,
    LIST_IMAGES,
    MARK_IMAGE,
    REGISTER_IMAGE,
    UPLOAD_IMAGE,
    DeleteImage,
    ImageList,
    ListImages,
    MarkImage,
    RegisterImage,
    UploadImageChunk,
    UploadReceived,
)
from libs.imagefiles import ImageArchiveError, detect_format, file_digest
from libs.messaging.responder import Route
from libs.telemetry.logs import get_logger
from services.scheduler.domain.images import LIST_HINT, canonical_ref
from services.scheduler.domain.names import image_change
from services.scheduler.interfaces import Scheduling

log = get_logger(__name__)
MAX_IMAGE_BYTES = 64 * 2**30  # an upload stops being taken past this
STALE_UPLOAD_SECONDS = 24 * 3600.0  # an upload nothing was added to is removed after this


def _admin_only(identity: Identity, what: str) -> CommandError | None:
    if identity.admin:
        return None
    return CommandError(code="forbidden", message=f"only administrators {what}",
                        hint="ask an administrator; `trainyard image list` shows the images there are")


class ImageCommands:
    def __init__(self, scheduler: Scheduling, *, storage_root: Path) -> None:
        self.scheduler = scheduler
        self.storage_root = storage_root
        self._uploading: dict[str, asyncio.Lock] = {}  # one chunk of an upload at a time

    def routes(self) -> list[Route]:
        return [
            (UPLOAD_IMAGE, self.upload),
            (REGISTER_IMAGE, self.register),
            (MARK_IMAGE, self.mark),
            (DELETE_IMAGE, self.delete),
            (LIST_IMAGES, self.list),
        ]

    async def upload(self, request: UploadImageChunk, identity: Identity) -> UploadReceived | CommandError:
        if error := _admin_only(identity, "upload images"):
            return error
        if request.offset + len(request.data) > MAX_IMAGE_BYTES:
            return CommandError(code="invalid-request", message=f"an image archive may hold at most "
                                f"{MAX_IMAGE_BYTES // 2**30} GiB", hint="make the image smaller")
        upload = held_upload(identity.user, request.upload_id)
        path = self.storage_root / upload_path(upload)
        lock = self._uploading.setdefault(upload, asyncio.Lock())
        async with lock:
            if request.offset == 0:  # an upload begins, or asks where to go on from
                await asyncio.to_thread(self._remove_stale_uploads, path.parent)
            if request.data:
                received = await asyncio.to_thread(_append, path, request.offset, request.data)
            else:
                received = await asyncio.to_thread(_held, path, request.offset)
        if received is None:
            size = await asyncio.to_thread(_size, path)
            return CommandError(code="conflict", message=f"upload {request.upload_id} holds {size} bytes; this "
                                f"chunk begins at {request.offset}", hint=f"send the archive on from byte {size}")
        return UploadReceived(upload_id=request.upload_id, received_bytes=received)

    def _remove_stale_uploads(self, folder: Path) -> None:
        now = time.time()
        for part in folder.glob("*.part"):
            try:
                if now - part.stat().st_mtime > STALE_UPLOAD_SECONDS:
                    part.unlink()
                    self._uploading.pop(part.stem, None)
            except FileNotFoundError:
                continue

    async def register(self, request: RegisterImage, identity: Identity) -> ImageList | CommandError:
        if error := _admin_only(identity, "register images"):
            return error
        ref = image_ref(request.name, request.tag)
        known = self.scheduler.state.images.get(ref)
        if known is not None and known.digest == request.digest and _as_asked(known, request):
            return ImageList(images=[known])  # registered by this request before (its answer was lost)
        if known is not None and not request.replace:
            return CommandError(code="conflict", message=f"{ref} is registered already ({known.digest[:19]})",
                                hint="register it with --replace to give it this archive, or choose another tag")
        upload = held_upload(identity.user, request.upload_id)
        part = self.storage_root / upload_path(upload)
        try:
            found = await asyncio.to_thread(file_digest, part)
        except FileNotFoundError:
            return CommandError(code="not-found", message=f"there is no upload {request.upload_id}",
                                hint="upload the archive first (`trainyard image register` does both)")
        if found != request.digest:
            await asyncio.to_thread(part.unlink, missing_ok=True)
            return CommandError(code="invalid-request", message=f"the upload's digest is {found}, not "
                                f"{request.digest}: it changed on its way", hint="register the image again")
        try:
            image_format = await asyncio.to_thread(detect_format, part, "the uploaded file")
        except ImageArchiveError as exc:
            await asyncio.to_thread(part.unlink, missing_ok=True)
            return CommandError(code="invalid-request", message=str(exc), hint="nothing was registered")
        blob = self.storage_root / image_archive(request.digest)
        size = await asyncio.to_thread(_keep, part, blob)
        record = ImageRecord(name=request.name, tag=request.tag, digest=request.digest, format=image_format,
                             size_bytes=size, boards=list(dict.fromkeys(request.boards)), training=request.training,
                             description=request.description, registered_by=identity.user,
                             registered_at=datetime.now(UTC))
        async with self.scheduler.lock:
            now = self.scheduler.state.images.get(ref)
            if now is not None and now != known and not request.replace:  # registered meanwhile by another request
                return CommandError(code="conflict", message=f"{ref} was registered meanwhile ({now.digest[:19]})",
                                    hint="register it with --replace to give it this archive, or choose another tag")
            await self.scheduler.record([image_change(ImageRegistered(image=record, by=identity.user))])
        self._uploading.pop(upload, None)
        log.info("scheduler.image_registered", image=ref, digest=request.digest, format=image_format, bytes=size)
        return ImageList(images=[record])

    async def mark(self, request: MarkImage, identity: Identity) -> ImageList | CommandError:
        if error := _admin_only(identity, "mark images"):
            return error
        found = self._find(request.ref)
        if isinstance(found, CommandError):
            return found
        async with self.scheduler.lock:
            if found.training != request.training:
                await self.scheduler.record([image_change(ImageMarked(ref=found.ref, training=request.training,
                                                                      by=identity.user))])
        return ImageList(images=[self.scheduler.state.images[found.ref]])

    async def delete(self, request: DeleteImage, identity: Identity) -> Done | CommandError:
        if error := _admin_only(identity, "delete images"):
            return error
        found = self._find(request.ref)
        if isinstance(found, CommandError):
            return found
        async with self.scheduler.lock:
            await self.scheduler.record([image_change(ImageDeleted(ref=found.ref, by=identity.user))])
            state = self.scheduler.state
            used = (any(image.digest == found.digest for image in state.images.values())
                    or any(job.image is not None and job.image.digest == found.digest for job in state.active.values()))
        if not used:  # no other tag names the archive and no unfinished job runs in it
            await asyncio.to_thread((self.storage_root / found.archive).unlink, missing_ok=True)
        return Done(job_ids=[], message=f"deleted image {found.ref}"
                    + ("" if not used else "; its archive stays while jobs or other tags use it"))

    async def list(self, request: ListImages, identity: Identity) -> ImageList | CommandError:
        if request.ref is None:
            return ImageList(images=sorted(self.scheduler.state.images.values(), key=lambda image: image.ref))
        found = self._find(request.ref)
        return found if isinstance(found, CommandError) else ImageList(images=[found])

    def _find(self, ref: str) -> ImageRecord | CommandError:
        try:
            canonical = canonical_ref(ref)
        except ImageRefError as exc:
            return CommandError(code="invalid-request", message=str(exc), hint="write NAME:TAG")
        found = self.scheduler.state.images.get(canonical)
        if found is None:
            return CommandError(code="not-found", message=f"{canonical} is not a registered image", hint=LIST_HINT)
        return found


def held_upload(user: str, upload_id: str) -> str:
    """The name an upload is held under: its sender's and its id's, so that nobody else may add to it, read it
    back, register it or learn how much of it there is by naming its id."""
    return hashlib.sha256(f"{user}\0{upload_id}".encode()).hexdigest()[:32]


def _as_asked(known: ImageRecord, request: RegisterImage) -> bool:
    return (known.boards == list(dict.fromkeys(request.boards)) and known.training == request.training
            and known.description == request.description)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _held(path: Path, offset: int) -> int | None:
    """How much of an upload is held, for a chunk without data (None when `offset` is past it). The upload is
    touched, so that it does not turn stale between this answer and the next chunk."""
    size = _size(path)
    if offset > size:
        return None
    try:
        os.utime(path)
    except FileNotFoundError:
        return 0
    return size


def _append(path: Path, offset: int, data: bytes) -> int | None:
    """Append a chunk at `offset`: the upload's new length; None when the chunk begins past what is there.
    What of the chunk is there already was taken before (its answer was lost, or two runs send one archive):
    only the rest is written. The digest checked at registration catches any difference."""
    size = _size(path)
    if offset > size:
        return None
    if offset + len(data) <= size:
        return size
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as out:
        out.write(data[size - offset:])
    return offset + len(data)


def _keep(part: Path, blob: Path) -> int:
    """Move an upload to its place among the archives (one rename: a node never reads half of one)."""
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, blob)
    return blob.stat().st_size
