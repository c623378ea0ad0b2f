"""Jobs in images on a node (SPEC J10): the image unpacked into the node's cache before the command starts,
pinned while a rank uses it, evicted by the dataset cache's rules, and what changes for a command run in it.

A rank of a job with an image has `prepare` unpack the image's archive (shared storage, `images/blobs/…`)
into the node's image cache (agent/caches/imagecache.py), or find it there; a line in the rank's output says which
and how long it took. The sandbox then shows the unpacked root filesystem as / (agent/isolation/sandbox.py). The pin
is dropped when the rank's folder goes: at its end, or when a kept environment is released (J15), since a
debug session runs in the same image. Each of these changes, and each eviction, sets `changed`: the node's
next cache report (agent/caches/preparation.py) lists the images as they are then.

The platform's helpers that run inside a job (`python3 -m agent.lifecycle`, MPI's `python3 -m agent.rsh`)
are run by the agent's own interpreter, bound into the sandbox at its host path: the image's python3 may be
another, or missing. That interpreter needs a C library like the host's (glibc), as any Debian, Ubuntu or
RHEL-like image has.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from agent.caches.imagecache import ImageCache, ImageRoot
from agent.output.tail import append_note
from agent.processes.jobenv import REMOTE_SHELL_MODULE, REMOTE_SHELL_VARIABLE, uses_agent_remote_shell
from libs.contracts.datacache import CachePolicy
from libs.contracts.images import ImageUse
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
CACHE_VARIABLE = "TRAINYARD_IMAGE_CACHE"  # where the node unpacks images (default: <agent root>/images)
# Host paths bound read-only at the same place into every image: an accelerator's user-space driver
# (docs/images.md lists NVIDIA's). Separated by ':'.
BINDS_VARIABLE = "TRAINYARD_IMAGE_BINDS"
HOUSEKEEP_SECONDS = 60.0
HELPER_PREFIX = "agent."


def host_binds(environ: Mapping[str, str] = os.environ) -> list[Path]:
    return [Path(part) for part in environ.get(BINDS_VARIABLE, "").split(":") if part.strip()]


def on_agent_python(argv: list[str], env: dict[str, str], python: str) -> tuple[list[str], dict[str, str]]:
    """`argv` and `env` with the platform's helpers (`python3 -m agent.…`) run by the agent's interpreter."""
    if argv[:2] == ["python3", "-m"] and len(argv) > 2 and argv[2].startswith(HELPER_PREFIX):
        argv = [python, *argv[1:]]
    if uses_agent_remote_shell(env):
        env = {**env, REMOTE_SHELL_VARIABLE: f"{python} -m {REMOTE_SHELL_MODULE}"}
    return argv, env


class ImagePreparation:
    def __init__(self, cache: ImageCache, node: str, storage: Path, policy: Callable[[], CachePolicy]) -> None:
        self.cache = cache
        self.node = node
        self.storage = storage
        self.policy = policy  # the dataset cache's, as the administrator set it
        self.wake = asyncio.Event()
        self.changed = asyncio.Event()  # something the cache reports show changed

    @classmethod
    def from_environment(cls, root: Path, storage: Path, node: str, policy: Callable[[], CachePolicy],
                         environ: Mapping[str, str] = os.environ) -> ImagePreparation:
        folder = Path(environ[CACHE_VARIABLE]) if environ.get(CACHE_VARIABLE) else root / "images"
        return cls(ImageCache(folder.absolute()), node, storage, policy)

    async def prepare(self, image: ImageUse, holder: str, folder: Path) -> ImageRoot:
        """The image unpacked (or found) and pinned for `holder`; raises ImageCacheError naming what failed."""
        began = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        found = await self.cache.acquire(self.storage / image.archive, image.digest, image.format, holder,
                                         ref=image.ref)
        self.changed.set()  # unpacked, or used and pinned again
        how = f"unpacked in {time.monotonic() - began:.1f} s" if found.cold else "found in the node's image cache"
        append_note(folder, f"image {image.ref} ({image.digest[:19]}): {how}")
        log.info("agent.image_ready", node=self.node, image=image.ref, digest=image.digest, cold=found.cold,
                 seconds=round(time.monotonic() - began, 3))
        return found

    def release(self, holder: str) -> None:
        """The rank's folder is gone: its image may be evicted again (by the next round, at once when it used one:
        a rank without an image, most of them, costs no look at the cache)."""
        if self.cache.release(holder):
            self.wake.set()
            self.changed.set()

    async def housekeeping(self) -> None:
        """Evict unpinned images by the dataset cache's policy every HOUSEKEEP_SECONDS (and when woken)."""
        while True:
            try:
                for key, cause in await asyncio.to_thread(self.cache.evict, self.policy(), now=datetime.now(UTC)):
                    log.info("agent.image_evicted", node=self.node, key=key, cause=cause)
                    self.changed.set()
            except OSError as exc:  # a disk that cannot be read now: the next round tries again
                log.warning("agent.image_housekeeping_failed", node=self.node, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), HOUSEKEEP_SECONDS)
            self.wake.clear()

