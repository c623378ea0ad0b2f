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
def _decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def decode(data: bytes | str, kind: type[T]) -> T:
    """Decode `data` as `kind` (a Struct or a union of tagged Structs)."""
    result: T = _decoder(kind).decode(data)  # type: ignore[arg-type]  # classes are hashable
    return result


def decode_any(data: bytes | str, kind: object) -> Any:
    """Decode `data` as a union type; callers match on the result's class."""
    return _decoder(kind).decode(data)
