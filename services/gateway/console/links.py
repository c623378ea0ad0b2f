"""One-time sign-in links: `make up` prints one for its administrator, so that the console opens signed in.

The link carries a random code in its fragment (`/signin#code=…`), which a browser never sends to a server nor
writes in a log; the sign-in page's script posts it once. The code names a file, in a folder only the gateway and
the one who issued the link can read, holding the token it stands for: redeeming moves the file aside (only one
of two racing redeemers can) and deletes it, so a code works once, and only within LIFETIME_SECONDS.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from pathlib import Path

LIFETIME_SECONDS = 900.0
CODE_BYTES = 32


def _file(folder: Path, code: str) -> Path:
    return folder / hashlib.sha256(code.encode()).hexdigest()


def issue(folder: Path, token: str) -> str:
    """A new code for `token`, written where the gateway reads it (the folder is made private to its owner)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    code = secrets.token_urlsafe(CODE_BYTES)
    path = _file(folder, code)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as written:
        written.write(token)
    return code


def redeem(folder: Path | None, code: str, *, now: float | None = None) -> str | None:
    """The token of a code not used before and not too old; None otherwise (and the code is used up)."""
    if folder is None or not code or len(code) > 128 or not code.replace("-", "").replace("_", "").isalnum():
        return None
    path = _file(folder, code)
    claimed = path.with_name(path.name + ".redeemed")
    try:
        os.rename(path, claimed)
    except OSError:
        return None
    try:
        age = (time.time() if now is None else now) - claimed.stat().st_mtime
        token = claimed.read_text().strip()
    finally:
        with contextlib.suppress(OSError):
            claimed.unlink()
    return token if age <= LIFETIME_SECONDS else None
