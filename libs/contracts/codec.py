"""JSON encoding of contract types: one encoder, typed decoders cached per type."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


@cache
def _decoder_of_value(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


# The decoders by the identity of the type asked for, a fast path in front of the cache by value: hashing a
# union hashes all of its members every time (about 1 µs for the union of every event, ten times the decoding
# of a small event). The type is kept with its decoder, so its id stays its own; a union written at a call
# site is a new object at every call, so the map is emptied when it grows past a bound.
_by_identity: dict[int, tuple[object, msgspec.json.Decoder[Any]]] = {}
IDENTITIES_KEPT = 512


def _decoder(kind: object) -> msgspec.json.Decoder[Any]:
    found = _by_identity.get(id(kind))
    if found is not None and found[0] is kind:
        return found[1]
    decoder = _decoder_of_value(kind)
    if len(_by_identity) >= IDENTITIES_KEPT:
        _by_identity.clear()
    _by_identity[id(kind)] = (kind, decoder)
    return decoder


def decode(data: bytes | str, kind: type[T]) -> T:
    """Decode `data` as `kind` (a Struct or a union of tagged Structs)."""
    result: T = _decoder(kind).decode(data)
    return result


def decode_any(data: bytes | str, kind: object) -> Any:
    """Decode `data` as a union type; callers match on the result's class."""
    return _decoder(kind).decode(data)
