"""Strict decoding for the platform's edges: unknown fields at any depth are errors.

The contract types themselves tolerate unknown fields, because stored events must survive newer
writers (a JobSubmitted carries a JobSpec). Where input comes from a person or a client (a job
file, a request) `decode_strict` refuses what the types do not know, with msgspec's own wording, so
`field_error_from_msgspec` names the field either way.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from msgspec import inspect


def unknown_fields(value: Any, kind: Any) -> list[tuple[str, str]]:
    """(parent path, field name) of every key in `value` that `kind` does not define."""
    found: list[tuple[str, str]] = []
    _walk(value, _type_info(kind), "", found)
    return found


@functools.lru_cache(maxsize=256)
def _type_info(kind: Any) -> inspect.Type:
    """What msgspec knows of `kind`: worked out once per type (it costs a millisecond for a request type)."""
    return inspect.type_info(kind)


def _walk(value: Any, info: inspect.Type, path: str, found: list[tuple[str, str]]) -> None:
    if not isinstance(value, dict | list):
        return  # a field's name is a key of an object, and only objects and arrays hold objects
    if isinstance(info, inspect.UnionType):
        info = _member_for(value, info)
    if isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {field.encode_name: field for field in info.fields}
        for key, item in value.items():
            if key == info.tag_field:
                continue
            if key not in fields:
                found.append((path, key))
            else:
                _walk(item, fields[key].type, f"{path}.{key}" if path else key, found)
    elif isinstance(info, inspect.ListType | inspect.SetType | inspect.FrozenSetType | inspect.VarTupleType):
        if isinstance(value, list):
            for index, item in enumerate(value):
                _walk(item, info.item_type, f"{path}[{index}]", found)
    elif isinstance(info, inspect.DictType) and isinstance(value, dict):
        for key, item in value.items():
            _walk(item, info.value_type, f"{path}.{key}" if path else str(key), found)


def _member_for(value: Any, union: inspect.UnionType) -> inspect.Type:
    """The struct a union value decodes as: by its tag, or the only struct in an Optional."""
    structs = [t for t in union.types if isinstance(t, inspect.StructType)]
    if isinstance(value, dict):
        for struct in structs:
            if struct.tag_field is not None and value.get(struct.tag_field) == struct.tag:
                return struct
        if len(structs) == 1:
            return structs[0]
    return inspect.AnyType()


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
