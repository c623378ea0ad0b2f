"""Image archives as an administrator registers them (SPEC J10): which kind a file is, and its digest.

A job's image is one of:
- an OCI archive (`podman save --format oci-archive`, `skopeo copy … oci-archive:image.tar`): a tar of an
  OCI image layout, with `oci-layout` and `index.json` at its top;
- a docker archive (`docker save`, `podman save`, `skopeo copy … docker-archive:image.tar`): a tar with
  `manifest.json` at its top;
- a root-filesystem tarball (`tar -C rootfs -cf image.tar .`): a tar whose top holds `etc/`, `usr/` or
  `bin/`.

Each may be compressed (gzip, bzip2, xz). Only the names of an archive's members are read, and reading stops
as soon as they tell: archives can be gigabytes.
"""

from __future__ import annotations

import hashlib
import lzma
import tarfile
import zlib
from pathlib import Path

from libs.contracts.images import ImageFormat

CHUNK = 1024 * 1024
ROOTFS_TOPS = frozenset({"etc", "usr", "bin"})  # a top-level folder that only a root filesystem has
HOW_TO_MAKE = ("make one with `podman save --format oci-archive`, `skopeo copy` or "
               "`tar -C rootfs -cf image.tar .`")


class ImageArchiveError(ValueError):
    """A file is not an image archive Trainyard can use; the message says what is wrong and what to do."""


def _top(name: str) -> tuple[str, bool]:
    """A member's first path component, and whether the member is that component itself (is at the top)."""
    while name.startswith("./"):
        name = name[2:]
    name = name.lstrip("/")
    first, _, rest = name.partition("/")
    return first, not rest.strip("/")


def detect_format(path: Path, name: str | None = None) -> ImageFormat:
    """Which kind of image archive `path` is, from its members' names; ImageArchiveError when it is none, naming
    the file `name` (its path unless given)."""
    called = name or str(path)
    seen: set[str] = set()  # names at the top
    read = 0
    try:
        with tarfile.open(path, mode="r:*") as archive:
            for member in archive:
                read += 1
                first, at_top = _top(member.name)
                if first in ROOTFS_TOPS:
                    return "rootfs"
                if at_top:
                    seen.add(first)
                if {"oci-layout", "index.json"} <= seen:
                    return "oci-archive"
                if "manifest.json" in seen:
                    return "docker-archive"
    except FileNotFoundError as exc:
        raise ImageArchiveError(f"{called} does not exist: give the path of an image archive") from exc
    except tarfile.ReadError as exc:
        if not read:
            raise ImageArchiveError(f"{called} is not a tar archive (plain, gzip, bzip2 or xz): {exc}; "
                                    f"{HOW_TO_MAKE}") from exc
        raise ImageArchiveError(f"{called} is a truncated or damaged tar archive ({exc}): "
                                "copy or save the image again") from exc
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise ImageArchiveError(f"{called} is a truncated or damaged tar archive ({exc}): "
                                "copy or save the image again") from exc
    except OSError as exc:
        raise ImageArchiveError(f"cannot read {called}: {exc.strerror or exc}") from exc
    raise ImageArchiveError(f"{called} is neither an OCI archive, a docker archive nor a root-filesystem tarball; "
                            f"{HOW_TO_MAKE}")


def file_digest(path: Path) -> str:
    """The file's SHA-256 digest, as "sha256:<hex>" (read in chunks of 1 MiB)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
