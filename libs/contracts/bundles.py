"""Events published together as one message (`subjects.bundle_subject`): its body is a JSON array of envelopes, those
of one kind of aggregate that one append recorded, in the order of the log. Whoever reads the events stream reads a
bundle's envelopes as if each had come alone, on `event_subject(service, aggregate type, event name)`."""

from __future__ import annotations

import msgspec

from libs.contracts.codec import decode, decode_any
from libs.contracts.events import EventEnvelope
from libs.contracts.subjects import is_bundle

BUNDLE_EVENTS = 64  # at most, so that a follower's run of messages decided together stays as bounded as before
BUNDLE_BYTES = 256 * 1024  # about, at most (an event larger than what is left goes into the next)


class _Positioned(msgspec.Struct):
    position: int | None = None


def bundle_parts(data: bytes) -> list[msgspec.Raw]:
    """A bundle's envelopes, each still encoded: one that does not decode spoils only itself. Raises
    msgspec.DecodeError (and ValidationError) when the body is not an array."""
    parts: list[msgspec.Raw] = decode_any(data, list[msgspec.Raw])
    return parts


def claimed_position(part: bytes) -> int | None:
    """The log position an encoded envelope claims, if it reads as JSON with one."""
    try:
        return decode(part, _Positioned).position
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def stored_envelopes(subject: str, data: bytes) -> list[EventEnvelope]:
    """The envelopes of one message of the events stream published on `subject`, a bundle's or the one it is, that
    decode (an event a follower set aside is left out, the rest of its bundle kept)."""
    return [envelope for _, envelope in placed_envelopes(subject, data)]


def placed_envelopes(subject: str, data: bytes) -> list[tuple[int | None, EventEnvelope]]:
    """`stored_envelopes`, each with its place in the bundle (from 0; None: the message is the one envelope)."""
    try:
        parts = list(enumerate(bundle_parts(data))) if is_bundle(subject) else [(None, msgspec.Raw(data))]
    except msgspec.DecodeError:
        return []
    envelopes: list[tuple[int | None, EventEnvelope]] = []
    for place, part in parts:
        try:
            envelopes.append((place, decode(part, EventEnvelope)))
        except msgspec.DecodeError:  # ValidationError is one
            continue
    return envelopes
