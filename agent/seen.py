"""The control plane's requests this node's agent obeyed, written down so that a restart does not make
them new again.

An agent obeys a signed request once (libs/controlsign.py): it keeps the request's signature until the
request is too old to be accepted anyway (`MAX_SKEW_SECONDS` after its signing). In memory only, a
restart would forget them, and a start captured on the wire would run its finished job again when sent
to the next agent within those seconds. So each signature is also written here, and synced to disk,
before the request is acted on (an agent killed right after has it on disk), and the next agent reads
them back before it serves anything.

The folder `requests-seen` is in the agent's own folder (`--root/<node>`), which jobs do not see: two
agents on one host each have theirs. A signature is a line `<until> <hex>` in the file of the minute it
can be forgotten in (`<minute>.seen`); a file whose minute is over is removed whole, so nothing is ever
rewritten. Lines that do not read (cut short by a power loss before their request was obeyed, or
damaged) are passed over: the verifier also refuses anything signed before its agent started, which
covers what they held, as it covers a wiped disk.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from libs.controlsign import ControlVerifier
from libs.telemetry.logs import get_logger

log = get_logger(__name__)

FOLDER_NAME = "requests-seen"
SUFFIX = ".seen"
MINUTE = 60


def minute_of(until: float) -> int:
    """The file a signature that can be forgotten at `until` goes into."""
    return int(until // MINUTE)


def minute_over(minute: int, now: float) -> bool:
    """Whether every signature in the file of `minute` can be forgotten at `now`."""
    return (minute + 1) * MINUTE <= now


def entry_line(signature: bytes, until: float) -> bytes:
    return f"{until:.3f} {signature.hex()}\n".encode()


def read_entries(text: bytes, now: float) -> tuple[dict[bytes, float], int]:
    """The signatures in a file's `text` still to be remembered at `now`, and how many lines did not read."""
    entries: dict[bytes, float] = {}
    unreadable = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            until_text, hex_text = line.decode("ascii").split(" ")
            until, signature = float(until_text), bytes.fromhex(hex_text)
        except ValueError:  # UnicodeDecodeError is one
            unreadable += 1
            continue
        if len(signature) != 64 or not math.isfinite(until):  # an ed25519 signature is 64 bytes
            unreadable += 1
        elif until >= now:
            entries[signature] = max(until, entries.get(signature, until))
    return entries, unreadable


def _minute_of_name(name: str) -> int | None:
    stem = name.removesuffix(SUFFIX)
    return int(stem) if name.endswith(SUFFIX) and stem.isdigit() else None


class SeenFolder:
    """The signatures an agent accepted, in its folder: a `SeenJournal` for its ControlVerifier."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: set[int] = set()  # the minutes whose files exist, their names on disk

    def load(self, now: float) -> dict[bytes, float]:
        """Every signature still to be remembered at `now`; files whose minute is over are removed. OSError
        when the folder cannot be made or read."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        seen: dict[bytes, float] = {}
        for path in sorted(self.folder.iterdir()):
            minute = _minute_of_name(path.name)
            if minute is None:  # not one of ours
                continue
            if minute_over(minute, now):
                path.unlink(missing_ok=True)
                continue
            text = path.read_bytes()
            if text and not text.endswith(b"\n"):  # a line cut short: the next one starts on a line of its own
                self._append(path, b"\n")
            entries, unreadable = read_entries(text, now)
            if unreadable:
                log.warning("agent.seen_requests_unreadable", file=str(path), lines=unreadable)
            for signature, until in entries.items():
                seen[signature] = max(until, seen.get(signature, until))
            self._files.add(minute)
        return seen

    def remember(self, signature: bytes, until: float, now: float) -> None:
        """Append `signature` to its minute's file and sync it; OSError when it cannot."""
        minute = minute_of(until)
        self._append(self.folder / f"{minute}{SUFFIX}", entry_line(signature, until))
        if minute not in self._files:  # a new file: its name is synced too
            self._sync_folder()
            self._files.add(minute)
        for over in [m for m in self._files if minute_over(m, now)]:
            (self.folder / f"{over}{SUFFIX}").unlink(missing_ok=True)
            self._files.discard(over)

    def _append(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if os.write(fd, data) != len(data):  # a regular file takes a short write whole unless it is full
                raise OSError(f"{path} took only part of a line (is the disk full?)")
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remember_across_restarts(control: ControlVerifier, root: Path, now: float) -> None:
    """Have `control` refuse what the agents before on this node obeyed: the signatures they wrote down in
    the agent folder `root`, and anything signed before `now`, this agent's start. SystemExit saying what to
    do when the folder cannot be read."""
    folder = SeenFolder(root / FOLDER_NAME)
    try:
        seen = folder.load(now)
    except OSError as exc:
        raise SystemExit(f"cannot read the requests this node's agent obeyed before, in {folder.folder} "
                         f"({exc.strerror or exc}): let the agent's user read and write it, or remove it (the agent "
                         "then refuses anything signed before it started all the same)") from None
    control.restore(folder, seen, now)
    log.info("agent.seen_requests_loaded", folder=str(folder.folder), signatures=len(seen))
