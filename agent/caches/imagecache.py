"""A node's image cache on its local disk (SPEC J10): each job image unpacked once, shared by the jobs using it.

    <cache>/entries/<key>/rootfs/      the image's root filesystem, unpacked
    <cache>/entries/<key>/entry.json   what it is: digest, format, size, environment, working directory, when,
                                       and the reference of the image it was unpacked for
    <cache>/entries/<key>/used         touched at every use: its modification time is the last use
    <cache>/pins/<key>/<holder>        one file per rank using it; an entry with pins is never removed
    <cache>/partial/<key>-<random>/    unpacks under way (and entries being removed); renamed into entries/
                                       only once complete, so a crash leaves nothing that is ever used
    <cache>/locks/<key>.lock           held while an entry is unpacked or removed: one unpack per entry, also
                                       between agents sharing a cache folder

An entry's key is the first 24 hex digits of its archive's SHA-256 digest. The archive is checked against
the digest it was registered with before it is unpacked, and what is unpacked is the file as hashed (read
through the descriptor that was hashed, so a file renamed over it meanwhile is not used). The unpacking is
done by existing tools: skopeo turns an OCI or docker archive into an OCI layout, umoci unpacks that (the
layout is removed then), and the environment and working directory come from the image's configuration;
a root-filesystem tarball is extracted by tar. An entry's size is what its root filesystem takes on disk
(allocated blocks). Jobs share an entry: it must be mounted read-only. What the cache keeps is decided by
agent/caches/cachepolicy.py, as for datasets. What it holds goes to the monitor with the node's cache reports
(`images`: `trainyard cache` and the console list them).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from agent.caches.cachefiles import holder_of_pin, locked, pin_name, remove_folder
from agent.caches.cachepolicy import Held, evictions
from agent.processes.jobenv import DEFAULT_PATH
from libs.contracts.datacache import CachedImage, CachePolicy, EvictionCause
from libs.contracts.images import ImageFormat
from libs.imagefiles import file_digest
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
KEY_DIGITS = 24
TAG = "image"  # the reference of the image in the temporary OCI layout
NODE_FAULTS = ("no space left on device", "read-only file system", "disk quota exceeded")


@dataclass(frozen=True)
class ImageRoot:
    """An unpacked image, pinned for its holder."""

    key: str
    rootfs: Path  # absolute
    env: dict[str, str]  # the image's own environment (PATH set to the usual one when the image sets none)
    workdir: str | None  # the image's working directory; None when it sets none (or a relative one)
    cold: bool  # unpacked by this acquire (False: it was cached, or another acquire unpacked it)


class ImageCacheError(Exception):
    """An image could not be had; the message names its archive, what went wrong and what to do."""

    node_fault: bool = False  # the node's own disk is at fault (full, read-only): another node may do

    def __init__(self, message: str, *, node_fault: bool = False) -> None:
        super().__init__(message)
        self.node_fault = node_fault


def image_key(digest: str) -> str:
    """The entry an archive of `digest` ("sha256:<64 hex>") is cached under."""
    if not (match := DIGEST.match(digest)):
        raise ImageCacheError(f"{digest!r} is not an image digest: it must be sha256:<64 hex digits>")
    return match.group(1)[:KEY_DIGITS]


@contextlib.contextmanager
def _cache_writes(root: Path) -> Iterator[None]:
    """An OSError inside is the node's disk failing the cache."""
    try:
        yield
    except OSError as exc:
        raise ImageCacheError(f"cannot write the image cache at {root}: {exc.strerror or exc}",
                              node_fault=True) from exc


def _disk_bytes(folder: Path) -> int:
    """What a folder takes on disk (allocated blocks; a file with several hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for parent, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            info = os.lstat(os.path.join(parent, name))
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    return total


def _image_config(layout: Path) -> tuple[dict[str, str], str | None]:
    """The environment and working directory an OCI layout's image `TAG` sets (its config's Env, WorkingDir)."""
    def blob(digest: str) -> Any:
        algorithm, _, hex_digits = digest.partition(":")
        return json.loads((layout / "blobs" / algorithm / hex_digits).read_text())

    index = json.loads((layout / "index.json").read_text())
    manifest = next((m for m in index["manifests"]
                     if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == TAG), None)
    if manifest is None:
        raise ValueError(f"no image tagged {TAG} in the layout skopeo made")
    config = blob(blob(manifest["digest"])["config"]["digest"]).get("config") or {}
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    env.setdefault("PATH", DEFAULT_PATH)
    workdir = config.get("WorkingDir") or None
    return env, workdir if workdir and workdir.startswith("/") else None


def _only_device_nodes_failed(stderr: str) -> bool:
    """tar's complaints when, not being root, it could not make the archive's device nodes (the sandbox gives
    a job its own /dev, so they are not needed)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return bool(lines) and all("Cannot mknod" in line or "Exiting with failure status" in line for line in lines)


async def _tool(command: Sequence[str | Path], archive: Path, *, pass_fds: Sequence[int] = (),
                tolerate: Callable[[str], bool] | None = None) -> None:
    """Run an unpacking tool; a failure is an ImageCacheError with the tool's last line of stderr."""
    tool = Path(str(command[0])).name
    try:
        process = await asyncio.create_subprocess_exec(
            *(str(part) for part in command), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, pass_fds=pass_fds)
    except FileNotFoundError as exc:
        raise ImageCacheError(f"cannot unpack the image archive {archive}: {tool} is not installed on this node "
                              "(install skopeo, umoci and tar: deploy/local/system-packages.sh)",
                              node_fault=True) from exc
    try:
        _, err = await process.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    stderr = err.decode(errors="replace")
    if process.returncode == 0 or (tolerate is not None and tolerate(stderr)):
        return
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {process.returncode}"
    raise ImageCacheError(f"cannot unpack the image archive {archive}: {tool} failed: {last}",
                          node_fault=any(fault in stderr.lower() for fault in NODE_FAULTS))


async def _unpack_into(source: str, archive: Path, image_format: ImageFormat, partial: Path,
                       fd: int) -> tuple[dict[str, str], str | None]:
    """Unpack the archive readable at `source` (through descriptor `fd`) into `partial`/rootfs; the image's
    environment and working directory."""
    rootless = os.geteuid() != 0
    rootfs = partial / "rootfs"
    if image_format == "rootfs":
        rootfs.mkdir()
        owners = ["--no-same-owner", "--no-same-permissions"] if rootless else ["--numeric-owner"]
        await _tool(["tar", "-xf", source, "-C", rootfs, *owners], archive, pass_fds=[fd],
                    tolerate=_only_device_nodes_failed if rootless else None)
        return {"PATH": DEFAULT_PATH}, None
    work = partial / "work"
    layout, bundle = work / "layout", work / "bundle"
    (work / "tmp").mkdir(parents=True)
    # The policy would only judge signatures, which local archives do not have; /etc/containers/policy.json
    # may be missing on a node, and skopeo refuses to run without one unless told so.
    await _tool(["skopeo", "--insecure-policy", "--tmpdir", work / "tmp", "copy", "--quiet",
                 f"{image_format}:{source}", f"oci:{layout}:{TAG}"], archive, pass_fds=[fd])
    try:
        env, workdir = await asyncio.to_thread(_image_config, layout)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ImageCacheError(f"cannot read the configuration of the image in {archive} ({exc}): "
                              "save or copy the image again") from exc
    await _tool(["umoci", "unpack", *(["--rootless"] if rootless else []), "--image", f"{layout}:{TAG}", bundle],
                archive)
    await asyncio.to_thread(os.rename, bundle / "rootfs", rootfs)
    await asyncio.to_thread(remove_folder, work)
    return env, workdir


class ImageCache:
    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.entries_dir, self.partial_dir = self.root / "entries", self.root / "partial"
        self.pins_dir, self.locks_dir = self.root / "pins", self.root / "locks"
        self._unpacking: dict[str, asyncio.Task[ImageRoot]] = {}  # unpacks under way in this process, by key

    # --- acquiring ------------------------------------------------------------------------------------

    async def acquire(self, archive: Path, digest: str, image_format: ImageFormat, holder: str,
                      ref: str = "") -> ImageRoot:
        """The unpacked image of `archive` (registered with `digest`), pinned for `holder`: unpacked now unless
        the cache has it. An image is unpacked once per node, by a task of its own that no caller's end
        cancels; every acquire of it meanwhile waits for that one. `ref`: the image's reference, kept with an
        entry unpacked now (the cache reports show it)."""
        key = image_key(digest)
        await asyncio.to_thread(self._pin, key, holder)  # pinned before it is looked for: no eviction takes it
        try:
            # Looked for under the entry's lock: an eviction that did not see the pin has renamed it away by then.
            found = None if key in self._unpacking else await asyncio.to_thread(self._root_locked, key)
            if found is None:
                task = self._unpacking.get(key)
                cold = task is None
                if task is None:
                    task = self._unpacking[key] = asyncio.create_task(
                        self._unpack(archive, digest, image_format, key, ref))
                    task.add_done_callback(lambda done: self._unpacked(key, done))
                made = await asyncio.shield(task)
                found = replace(made, cold=cold and made.cold)
        except BaseException:
            self._unpin(key, holder)
            raise
        await asyncio.to_thread(self._touch, key)
        return found

    def _unpacked(self, key: str, task: asyncio.Task[ImageRoot]) -> None:
        self._unpacking.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: the callers were told, or had gone

    async def _unpack(self, archive: Path, digest: str, image_format: ImageFormat, key: str,
                      ref: str = "") -> ImageRoot:
        """Unpack under the entry's lock; not `cold` when another agent sharing the cache unpacked it first."""
        held = contextlib.ExitStack()
        try:
            with _cache_writes(self.root):
                await asyncio.to_thread(held.enter_context, locked(self.locks_dir / f"{key}.lock"))
            if found := await asyncio.to_thread(self._root, key):
                return found
            started = time.monotonic()
            with self._opened(archive) as fd:
                source = f"/proc/self/fd/{fd}"  # the file as hashed, even if another is renamed over it meanwhile
                try:
                    actual = await asyncio.to_thread(file_digest, Path(source))
                except OSError as exc:
                    raise ImageCacheError(f"cannot read the image archive {archive}: {exc.strerror or exc}") from exc
                if actual != digest:
                    raise ImageCacheError(
                        f"the image archive {archive} is not the one registered: its digest is {actual}, not "
                        f"{digest}; register the image again")
                partial = self.partial_dir / f"{key}-{secrets.token_hex(4)}"
                with _cache_writes(self.root):
                    partial.mkdir(parents=True)
                try:
                    with _cache_writes(self.root):  # the tools' own failures are ImageCacheErrors already
                        env, workdir = await _unpack_into(source, archive, image_format, partial, fd)
                        return await asyncio.to_thread(self._commit, key, digest, image_format, env, workdir,
                                                       partial, time.monotonic() - started, ref)
                except BaseException:
                    await asyncio.to_thread(remove_folder, partial)
                    raise
        finally:
            await asyncio.to_thread(held.close)

    @contextlib.contextmanager
    def _opened(self, archive: Path) -> Iterator[int]:
        try:
            fd = os.open(archive, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ImageCacheError(f"the image archive {archive} does not exist: the image must be registered "
                                  "again (its archive is gone from shared storage)") from exc
        except OSError as exc:
            raise ImageCacheError(f"cannot read the image archive {archive}: {exc.strerror or exc}") from exc
        try:
            yield fd
        finally:
            os.close(fd)

    def _commit(self, key: str, digest: str, image_format: ImageFormat, env: dict[str, str], workdir: str | None,
                partial: Path, seconds: float, ref: str = "") -> ImageRoot:
        size = _disk_bytes(partial / "rootfs")
        (partial / "entry.json").write_text(json.dumps({
            "key": key, "digest": digest, "format": image_format, "bytes": size, "env": env, "workdir": workdir,
            "unpacked_at": datetime.now(UTC).isoformat(), "ref": ref}))
        (partial / "used").touch()
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        os.rename(partial, self.entries_dir / key)  # atomic: the entry exists whole or not at all
        log.info("imagecache.unpacked", key=key, digest=digest, format=image_format, bytes=size,
                 seconds=round(seconds, 3))
        return ImageRoot(key=key, rootfs=self.entries_dir / key / "rootfs", env=env, workdir=workdir, cold=True)

    def _read(self, key: str) -> dict[str, Any] | None:
        try:
            found = json.loads((self.entries_dir / key / "entry.json").read_text())
            return found if isinstance(found, dict) else None
        except (OSError, ValueError):
            return None

    def _root(self, key: str) -> ImageRoot | None:
        if (found := self._read(key)) is None:
            return None
        return ImageRoot(key=key, rootfs=self.entries_dir / key / "rootfs", env=dict(found.get("env") or {}),
                         workdir=found.get("workdir"), cold=False)

    def _root_locked(self, key: str) -> ImageRoot | None:
        with _cache_writes(self.root), locked(self.locks_dir / f"{key}.lock"):
            return self._root(key)

    def _touch(self, key: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.entries_dir / key / "used")

    # --- pins -----------------------------------------------------------------------------------------

    def _pin(self, key: str, holder: str) -> None:
        with _cache_writes(self.root):
            folder = self.pins_dir / key
            folder.mkdir(parents=True, exist_ok=True)
            (folder / pin_name(holder)).touch()

    def _unpin(self, key: str, holder: str) -> None:
        with contextlib.suppress(OSError):
            (self.pins_dir / key / pin_name(holder)).unlink()

    def release(self, holder: str) -> bool:
        """`holder` uses no image any more; whether it used one (nothing happens when it used none)."""
        released = False
        for pin in self.pins_dir.glob(f"*/{pin_name(holder)}"):
            with contextlib.suppress(OSError):
                pin.unlink()
                released = True
        return released

    def unpin_all_but(self, holders: set[str]) -> None:
        """At start: pins of holders that no longer use an image here are gone (a crashed agent's)."""
        keep = {pin_name(holder) for holder in holders}
        for pin in self.pins_dir.glob("*/*"):
            if pin.name not in keep:
                with contextlib.suppress(OSError):
                    pin.unlink()

    # --- inventory and eviction -----------------------------------------------------------------------

    def _pinned(self, key: str) -> bool:
        folder = self.pins_dir / key
        return folder.is_dir() and any(folder.iterdir())

    def entries(self) -> list[Held]:
        """Every entry as the cache policy sees it (an unreadable one is left out: `evict` removes it)."""
        held = []
        for folder in sorted(self.entries_dir.glob("*")):
            found = self._read(folder.name)
            with contextlib.suppress(OSError):
                used = datetime.fromtimestamp((folder / "used").stat().st_mtime, UTC)
                if found is not None:
                    held.append(Held(key=folder.name, bytes=int(found.get("bytes", 0)), last_used=used,
                                     pinned=self._pinned(folder.name)))
        return held

    def images(self) -> list[CachedImage]:
        """Every entry as the node's cache reports show it, the most recently used first (blocking: run it in a
        thread). One that cannot be read, or whose entry.json does not check out, is left out: a report with it
        would be refused whole."""
        found = []
        for folder in sorted(self.entries_dir.glob("*")):
            entry = self._read(folder.name)
            try:
                used = datetime.fromtimestamp((folder / "used").stat().st_mtime, UTC)
                pins = sorted(holder_of_pin(pin.name) for pin in (self.pins_dir / folder.name).glob("*"))
                if entry is not None:
                    found.append(msgspec.convert({
                        "key": folder.name, "digest": entry.get("digest"), "ref": entry.get("ref") or "",
                        "format": entry.get("format"), "bytes": entry.get("bytes"), "last_used": used,
                        "unpacked_at": entry.get("unpacked_at"), "pins": pins}, CachedImage))
            except (OSError, msgspec.ValidationError):
                continue
        return sorted(found, key=lambda image: image.last_used, reverse=True)

    def evict(self, policy: CachePolicy, *, now: datetime) -> list[tuple[str, EvictionCause]]:
        """Remove what `policy` says to, by the rules of the dataset cache (blocking: run it in a thread); what
        was removed and why. Entries that cannot be read are removed too."""
        held = self.entries()
        known = {entry.key for entry in held}
        usage = shutil.disk_usage(self.root)
        chosen = evictions(held, policy, disk_bytes=usage.total, disk_used_bytes=usage.used, now=now)
        chosen += [(folder.name, "unreadable") for folder in sorted(self.entries_dir.glob("*"))
                   if folder.name not in known and folder.name not in self._unpacking]
        return [(key, cause) for key, cause in chosen if key not in self._unpacking and self._evict(key, cause)]

    def _evict(self, key: str, cause: EvictionCause) -> bool:
        """Whether the entry was removed (not when it was pinned since it was listed)."""
        with locked(self.locks_dir / f"{key}.lock"):
            if self._pinned(key):
                return False
            doomed = self.partial_dir / f"{key}-evicted-{secrets.token_hex(4)}"
            try:
                self.partial_dir.mkdir(parents=True, exist_ok=True)
                os.rename(self.entries_dir / key, doomed)  # gone for every user at once
            except OSError:
                return False
        remove_folder(doomed)
        log.info("imagecache.evicted", key=key, cause=cause)
        return True

    def clean_partial(self) -> None:
        """At start: make the cache's folders, and remove what a crash left half unpacked or half removed (not
        what another agent sharing the folder is unpacking: its entry's lock is held)."""
        for folder in (self.entries_dir, self.partial_dir, self.pins_dir, self.locks_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for leftover in self.partial_dir.iterdir():
            key = leftover.name.partition("-")[0]
            with (self.locks_dir / f"{key}.lock").open("a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being unpacked
                remove_folder(leftover)  # the lock goes with the file's closing
