"""Signed requests from the control plane to node agents: an agent obeys only the launcher and the monitor.

NATS already lets only the launcher publish start and stop requests on an agent's subjects, and only the
monitor pre-checks, releases and debug sessions (libs/natsroles.py). An agent does not rest on that
alone: each of those requests carries an ed25519 signature of the service that sent it, over the
subject, the time and the body, and the agent refuses one that is unsigned, signed by the wrong
service or with another key, older than `MAX_SKEW_SECONDS` (or as far in the future), or seen before.

What an agent has seen outlives it: before it obeys a request it writes the signature down (a `SeenJournal`,
agent/seen.py), and the next agent on the node reads them back; that one also refuses anything signed before
it started, which covers a disk that lost them. So a start captured on the wire and sent again after the
agent restarted does not run a finished job again.

The two services hold no key of their own to provision: each derives its signing key from the platform
secret it already holds (an HMAC of the role's name), and a node credential, issued with the same
secret (`trainyard admin node-token`), carries the public keys its agent trusts. Rotating the secret
rotates both, as it renews every credential.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

ControlRole = Literal["launcher", "monitor"]
CONTROL_ROLES: tuple[ControlRole, ...] = get_args(ControlRole)
SIGNATURE_HEADER = "Trainyard-Signature"
# How far a request's time may be from the agent's clock: machines keep time with NTP to well under this,
# and a signature is accepted only once within it.
MAX_SKEW_SECONDS = 120.0


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signing_key(secret: str, role: ControlRole) -> SigningKey:
    seed = hmac.new(secret.encode(), f"trainyard control-plane signing key: {role}".encode(), hashlib.sha256).digest()
    return SigningKey(seed)


def control_public_keys(secret: str) -> dict[str, str]:
    """The public key of each control-plane role, as a node credential carries them."""
    return {role: _b64(bytes(_signing_key(secret, role).verify_key)) for role in CONTROL_ROLES}


def _signed_text(role: str, subject: str, millis: int, nonce: str, body: bytes) -> bytes:
    return b"\n".join([b"trainyard-control-v1", role.encode(), subject.encode(), str(millis).encode(),
                       nonce.encode(), hashlib.sha256(body).digest()])


@dataclass(frozen=True)
class ControlSigner:
    """Signs a service's requests to agents."""

    role: ControlRole
    key: SigningKey

    @classmethod
    def of(cls, secret: str, role: ControlRole) -> ControlSigner:
        return cls(role, _signing_key(secret, role))

    def headers(self, subject: str, body: bytes, now: float) -> dict[str, str]:
        # The nonce makes two sends of the same request in the same millisecond two requests, not a replay.
        millis, nonce = int(now * 1000), secrets.token_hex(8)
        signature = self.key.sign(_signed_text(self.role, subject, millis, nonce, body)).signature
        return {SIGNATURE_HEADER: f"{self.role}.{millis}.{nonce}.{_b64(signature)}"}


class ControlKeysMissing(ValueError):
    """A node credential that names no control-plane keys (issued before requests were signed)."""


def parse_control_keys(keys: object) -> dict[ControlRole, VerifyKey]:
    """The verify keys in a node credential's `control_keys` claim; ControlKeysMissing when any is absent or bad."""
    if not isinstance(keys, Mapping):
        raise ControlKeysMissing("the node credential carries no control-plane keys")
    parsed: dict[ControlRole, VerifyKey] = {}
    for role in CONTROL_ROLES:
        text = keys.get(role)
        try:
            raw = _unb64(text) if isinstance(text, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 32:
            raise ControlKeysMissing(f"the node credential carries no valid {role} key")
        parsed[role] = VerifyKey(raw)
    return parsed


class SeenJournal(Protocol):
    """Where a verifier writes down the requests it accepts, for the next agent on the node to refuse them."""

    def remember(self, signature: bytes, until: float, now: float) -> None:
        """Write `signature` down to stay until `until`, on disk before returning; OSError when it cannot."""


@dataclass
class ControlVerifier:
    """An agent's check of the signatures on the requests it obeys."""

    keys: Mapping[ControlRole, VerifyKey]
    max_skew_seconds: float = MAX_SKEW_SECONDS
    # Nothing signed before this (the agent's start) is obeyed: the agent before may have obeyed it.
    not_before: float = 0.0
    journal: SeenJournal | None = None
    _seen: dict[bytes, float] = field(default_factory=dict)  # signature -> when it can be forgotten
    # The same, soonest forgotten first: what is over is found without a look at every signature at each request.
    _expiring: list[tuple[float, bytes]] = field(default_factory=list)

    @classmethod
    def of_secret(cls, secret: str) -> ControlVerifier:
        return cls(parse_control_keys(control_public_keys(secret)))

    def restore(self, journal: SeenJournal, seen: Mapping[bytes, float], now: float) -> None:
        """Go on from what the agents before accepted (`seen`, read back from `journal`), writing into
        `journal` from now on, and refuse whatever was signed before `now`, this agent's start."""
        self.journal, self.not_before = journal, now
        for signature, until in seen.items():
            self._note(signature, max(until, self._seen.get(signature, until)))

    def refusal(self, role: ControlRole, subject: str, body: bytes, headers: Mapping[str, str] | None,
                now: float) -> str | None:
        """Why a request on `subject` is not `role`'s own, recent and new; None when it is (and is now spent,
        written down in the journal first)."""
        value = (headers or {}).get(SIGNATURE_HEADER)
        if not value:
            return f"only the {role} may send this, and the request is not signed"
        parts = value.split(".")
        if len(parts) != 4 or not parts[1].isdigit() or len(parts[1]) > 15:
            return f"the request's {SIGNATURE_HEADER} header is malformed"
        signer, millis_text, nonce, signature_text = parts
        if signer != role:
            return f"only the {role} may send this, and the request is signed as {signer[:40]!r}"
        millis = int(millis_text)
        if abs(now - millis / 1000) > self.max_skew_seconds:
            return (f"the request was signed {now - millis / 1000:+.0f}s from this node's clock, over the "
                    f"{self.max_skew_seconds:g}s allowed: check both machines' clocks")
        try:
            signature = _unb64(signature_text)
            self.keys[role].verify(_signed_text(role, subject, millis, nonce, body), signature)
        except (BadSignatureError, binascii.Error, ValueError):
            return f"the {role}'s signature does not verify: the request was altered or signed with another key"
        self._forget(now)
        if signature in self._seen:  # the decoded bytes: another base64 spelling of it is the same signature
            return "the request was already received once: a replay is refused"
        if millis < int(self.not_before * 1000):  # compared in the header's milliseconds, which round down
            return ("the request was signed before this agent started, and the agent before may have obeyed "
                    "it: it is refused (its sender sends it again, signed anew)")
        until = millis / 1000 + self.max_skew_seconds
        if self.journal is not None:
            try:
                self.journal.remember(signature, until, now)
            except OSError as exc:  # obeyed unwritten, it could be replayed to the next agent
                return (f"this node cannot write the request down before obeying it ({exc.strerror or exc}): "
                        "free space on the agent's disk, or let its user write its folder")
        self._note(signature, until)
        return None

    def _note(self, signature: bytes, until: float) -> None:
        self._seen[signature] = until
        heapq.heappush(self._expiring, (until, signature))

    def _forget(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] < now:
            until, signature = heapq.heappop(self._expiring)
            if self._seen.get(signature) == until:  # not noted again to stay longer since
                del self._seen[signature]
