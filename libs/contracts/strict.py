"""Strict decoding for the platform's edges: unknown fields at any depth are errors.

The contract types themselves tolerate unknown fields, because stored events must survive newer
writers (a JobSubmitted carries a JobSpec). Where input comes from a person or a client (a job
file, a request) `decode_strict` refuses what the types do not know, with msgspec's own wording, so
`field_error_from_msgspec` names the field either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import inspect

Found = list[tuple[str, str]]
Check = Callable[[Any, str, Found], None]  # check(value, path, found): adds the unknown keys under `value`


def unknown_fields(value: Any, kind: Any) -> Found:
    """(parent path, field name) of every key in `value` that `kind` does not define."""
    found: Found = []
    check = _check_for(kind)
    if check is not None:
        check(value, "", found)
    return found


@functools.lru_cache(maxsize=256)
def _check_for(kind: Any) -> Check | None:
    """What checks a decoded `kind`, made once per type from what msgspec knows of it (a millisecond for a
    request type): a value is then looked at only where an object can be (a field's name is a key of an
    object), so a request's scalars and lists of scalars cost nothing. None: `kind` holds no object."""
    return _Checks().of(inspect.type_info(kind))


class _Checks:
    """The checks of one type's parts, each made once (a type may hold itself: a struct's check is found
    through its entry while it is being made). Parts are known by id: the type being made holds them all."""

    def __init__(self) -> None:
        self._made: dict[int, Check | None] = {}

    def of(self, info: inspect.Type) -> Check | None:
        key = id(info)
        if key in self._made:
            return self._made[key]
        if isinstance(info, inspect.StructType):
            return self._struct(info, key)
        check: Check | None = None
        if isinstance(info, inspect.UnionType):
            check = self._union(info)
        elif isinstance(info, inspect.ListType | inspect.SetType | inspect.FrozenSetType | inspect.VarTupleType):
            check = _items(self.of(info.item_type))
        elif isinstance(info, inspect.DictType):
            check = _values(self.of(info.value_type))
        self._made[key] = check
        return check

    def _struct(self, info: inspect.StructType, key: int) -> Check:
        fields: dict[str, Check | None] = {}
        tag_field = info.tag_field

        def check(value: Any, path: str, found: Found) -> None:
            if not isinstance(value, dict):
                return
            for name, item in value.items():
                if name not in fields:
                    if name != tag_field:
                        found.append((path, name))
                elif (inner := fields[name]) is not None and isinstance(item, dict | list):
                    inner(item, f"{path}.{name}" if path else name, found)

        self._made[key] = check  # before its fields: one of them may hold this struct again
        fields.update((field.encode_name, self.of(field.type)) for field in info.fields)
        return check

    def _union(self, info: inspect.UnionType) -> Check | None:
        """An object in a union is checked as the struct it decodes as (by its tag, or the only struct of an
        Optional); anything else in it is not looked into."""
        structs = [(member, self.of(member)) for member in info.types if isinstance(member, inspect.StructType)]
        if not structs:
            return None
        tagged = {member.tag: check for member, check in structs if member.tag_field is not None}
        tag_fields = {member.tag_field for member, _ in structs if member.tag_field is not None}
        only = structs[0][1] if len(structs) == 1 else None

        def check(value: Any, path: str, found: Found) -> None:
            if not isinstance(value, dict):
                return
            for tag_field in tag_fields:
                if (member := tagged.get(value.get(tag_field))) is not None:
                    member(value, path, found)
                    return
            if only is not None:
                only(value, path, found)

        return check


def _items(inner: Check | None) -> Check | None:
    if inner is None:
        return None

    def check(value: Any, path: str, found: Found) -> None:
        if isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict | list):
                    inner(item, f"{path}[{index}]", found)

    return check


def _values(inner: Check | None) -> Check | None:
    if inner is None:
        return None

    def check(value: Any, path: str, found: Found) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, dict | list):
                    inner(item, f"{path}.{key}" if path else str(key), found)

    return check


def decode_strict(data: bytes | str, kind: Any, *, yaml: bool = False) -> Any:
    """Decode JSON (or YAML) as `kind`, refusing unknown fields anywhere in it.

    Input nested too deeply to decode (a few KiB of `[` suffice) is a DecodeError like any other
    malformed input, not a RecursionError."""
    try:
        raw = msgspec.yaml.decode(data) if yaml else msgspec.json.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("the document is nested too deeply") from None
    unknown = unknown_fields(raw, kind)
    if unknown:
        parent, name = unknown[0]
        where = f" - at `$.{parent}`" if parent else ""
        raise msgspec.ValidationError(f"Object contains unknown field `{name}`{where}")
    try:
        return msgspec.convert(raw, kind)
    except RecursionError:
        raise msgspec.DecodeError("the document is nested too deeply") from None
