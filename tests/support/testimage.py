"""A small real Debian image for the image tests, built without any registry, once per machine.

    <cache>/bookworm-v1/rootfs.tar        the root filesystem as a plain tarball
    <cache>/bookworm-v1/image.oci.tar     the same as an OCI archive (what `oci-archive:` reads)
    <cache>/bookworm-v1/image.docker.tar  the same as a docker archive (what `docker save` writes)

<cache> is `~/.cache/trainyard/test-images` unless TRAINYARD_TEST_IMAGE_CACHE says otherwise: outside the
repository, so that every checkout and test run shares it. The root filesystem is made by debootstrap
(minbase with python3) from the machine's Debian mirror; umoci makes the OCI layout (with its own
environment variable TRAINYARD_IMAGE_VAR=from-image and working directory /srv) and skopeo turns it into a
docker archive. The image is marked so that a test can tell it from the host, a Debian 12 too: its
os-release says VARIANT_ID=trainyard-test-image and it holds /etc/trainyard-test-image.

A build takes minutes and happens under a lock, in a folder renamed into place only once complete: two
test processes never build it twice and a half-built image is never used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from agent.caches.cachefiles import locked
from agent.processes.jobenv import DEFAULT_PATH

CACHE_VARIABLE = "TRAINYARD_TEST_IMAGE_CACHE"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
RECIPE = "bookworm-v1"  # a change of how the image is made needs a new name: old caches are then ignored
TAG = "trainyard-test"
DOCKER_REFERENCE = "trainyard/test:1"
MARK_FILE = "etc/trainyard-test-image"
MARK_TEXT = "the Trainyard test image, not the host\n"
VARIANT = "trainyard-test-image"
IMAGE_VARIABLE = ("TRAINYARD_IMAGE_VAR", "from-image")
WORKDIR = "/srv"
PATH_VALUE = DEFAULT_PATH  # the PATH the OCI and docker archives set
TOOLS = ("debootstrap", "umoci", "skopeo", "tar")


@dataclass(frozen=True)
class TestImage:
    """The three archives of the test image (all of the same root filesystem)."""

    __test__: ClassVar[bool] = False  # not a test class, although its name starts with Test

    rootfs_tar: Path
    oci_archive: Path
    docker_archive: Path


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "trainyard" / "test-images")


def _built(folder: Path) -> TestImage:
    return TestImage(rootfs_tar=folder / "rootfs.tar", oci_archive=folder / "image.oci.tar",
                     docker_archive=folder / "image.docker.tar")


def _complete(folder: Path) -> TestImage | None:
    image = _built(folder)
    done = (folder / "built.json").is_file() and all(
        p.is_file() for p in (image.rootfs_tar, image.oci_archive, image.docker_archive))
    return image if done else None


def mirror() -> str:
    """The machine's Debian mirror (from apt's sources), else deb.debian.org."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    with contextlib.suppress(OSError):
        for stanza in re.split(r"\n\s*\n", sources.read_text()):
            fields: dict[str, str] = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, flags=re.MULTILINE))
            if SUITE in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0].rstrip("/")
    with contextlib.suppress(OSError):
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return next(p for p in parts[1:] if not p.startswith("[")).rstrip("/")
    return DEFAULT_MIRROR


@functools.cache
def _mirror_problem(url: str) -> str | None:
    release = f"{url}/dists/{SUITE}/Release"
    try:
        with urllib.request.urlopen(urllib.request.Request(release, method="HEAD"), timeout=15):
            return None
    except (urllib.error.URLError, OSError) as exc:
        return f"the Debian mirror {url} is unreachable ({release}: {exc}), so the test image cannot be built"


def test_image_problem() -> str | None:
    """Why the test image cannot be had on this machine (for `pytest.skip`), or None when it can."""
    if _complete(cache_root() / RECIPE):
        return None
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed, so the test image cannot be built: "
                "run deploy/local/system-packages.sh (or apt-get install skopeo umoci debootstrap)")
    if os.geteuid() != 0:
        return "debootstrap needs root to build the test image, and the tests do not run as root"
    return _mirror_problem(mirror())


test_image_problem.__test__ = False  # type: ignore[attr-defined]


def _say(message: str) -> None:
    print(f"test image: {message}", file=sys.stderr, flush=True)


def _run(command: Sequence[str | Path], **options: object) -> None:
    """Run a build step, its output shown on stderr; a failure names the step and its last lines."""
    _say("$ " + " ".join(str(part) for part in command))
    done = subprocess.run([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False, **options)  # type: ignore[call-overload]
    if done.stdout:
        sys.stderr.write(done.stdout)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise RuntimeError(f"building the test image failed at `{command[0]}` (exit {done.returncode}):\n{tail}")


def _debootstrap(rootfs: Path) -> None:
    """debootstrap's progress goes to stderr as it happens: it is the step that takes minutes."""
    command = ["debootstrap", "--variant=minbase", "--include=python3", SUITE, str(rootfs), mirror()]
    _say("$ " + " ".join(command))
    done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        log = rootfs / "debootstrap" / "debootstrap.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:]) if log.is_file() else ""
        raise RuntimeError(f"debootstrap failed (exit {done.returncode}); its log ends:\n{tail}")


def _mark(rootfs: Path) -> None:
    os_release = rootfs / "usr/lib/os-release"
    text = os_release.read_text()
    os_release.write_text(text + ("" if text.endswith("\n") else "\n") + f"VARIANT_ID={VARIANT}\n")
    (rootfs / MARK_FILE).write_text(MARK_TEXT)
    (rootfs / WORKDIR.lstrip("/")).mkdir(exist_ok=True)
    # What debootstrap leaves for apt is of no use in a test and a third of the image.
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_file():
                path.unlink()


def _build(work: Path) -> None:
    started = time.monotonic()
    rootfs, layout, bundle = work / "rootfs", work / "layout", work / "bundle"
    _say(f"building in {work} (debootstrap from {mirror()}: minutes the first time, then cached)")
    _debootstrap(rootfs)
    _mark(rootfs)
    _run(["tar", "--numeric-owner", "-C", rootfs, "-cf", work / "rootfs.tar", "."])
    image = f"{layout}:{TAG}"
    _run(["umoci", "init", "--layout", layout])
    _run(["umoci", "new", "--image", image])
    _run(["umoci", "unpack", "--image", image, bundle])
    (bundle / "rootfs").rmdir()
    rootfs.rename(bundle / "rootfs")  # the bundle's root is now the image's: repack makes it one layer
    _run(["umoci", "repack", "--image", image, bundle])
    _run(["umoci", "config", "--image", image, f"--config.env=PATH={PATH_VALUE}",
          f"--config.env={IMAGE_VARIABLE[0]}={IMAGE_VARIABLE[1]}", f"--config.workingdir={WORKDIR}",
          "--config.cmd=/bin/sh"])
    _run(["umoci", "gc", "--layout", layout])
    shutil.rmtree(bundle)
    _run(["tar", "-C", layout, "-cf", work / "image.oci.tar", "oci-layout", "index.json", "blobs"])
    _run(["skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{image}",
          f"docker-archive:{work / 'image.docker.tar'}:{DOCKER_REFERENCE}"])
    shutil.rmtree(layout)
    seconds = round(time.monotonic() - started, 1)
    sizes = {p.name: p.stat().st_size for p in sorted(work.glob("*.tar"))}
    (work / "built.json").write_text(json.dumps({"recipe": RECIPE, "mirror": mirror(), "seconds": seconds,
                                                 "bytes": sizes}, indent=2) + "\n")
    _say(f"built in {seconds} s: " + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))



def test_image() -> TestImage:
    """The test image's archives, built now unless this machine has them (check `test_image_problem` first)."""
    root = cache_root()
    final = root / RECIPE
    if found := _complete(final):
        return found
    with locked(root / f"{RECIPE}.lock"):
        if found := _complete(final):  # another process built it while this one waited
            return found
        for leftover in [*root.glob(f"{RECIPE}-building-*"), final]:  # an interrupted build's
            shutil.rmtree(leftover, ignore_errors=True)
        work = root / f"{RECIPE}-building-{secrets.token_hex(4)}"
        work.mkdir(parents=True)
        try:
            _build(work)
            work.rename(final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    built = _complete(final)
    assert built is not None
    return built


test_image.__test__ = False  # type: ignore[attr-defined]
