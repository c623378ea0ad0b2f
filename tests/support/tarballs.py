"""Small image archives for the tests of uploads and the catalogue (a real image is tests/support/testimage.py)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path


def rootfs_tarball(path: Path, payload_bytes: int = 0) -> Path:
    """A small root-filesystem tarball; `payload_bytes` of random data (no two alike) make it span several upload
    chunks."""
    with tarfile.open(path, "w") as archive:
        for name, data in (("etc/os-release", b"ID=tiny\n"), ("usr/bin/payload", os.urandom(payload_bytes))):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return path
