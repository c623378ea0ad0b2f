"""Overrides of a job spec's fields: a clone's (O1), applied by the scheduler to its source's spec, and
`trainyard submit --set`'s, applied by the CLI to the spec it read.

An override's key is a top-level field of the spec (`nodes`), replaced whole, or a dotted path into a field that
holds a mapping (`checkpoint_resume.max_resumes`, `env.SEED`), which replaces that one entry and keeps its
siblings. Overrides apply in their order, so a later one wins: a whole field after a path into it replaces what the
path set. A path through an absent or null field makes it a mapping; the merged spec is then decoded strictly, which
refuses a field the spec does not have at any depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from libs.contracts.jobspec import FieldError, JobSpec, SpecError, check_document_size

# Deeper than any field of a job spec (checkpoint_resume.performance.threshold is three): a longer path can
# only be a mistake, or a request built to nest the merged spec too deeply to encode.
MAX_PATH_PARTS = 6
# More than a person sets at once by far; the merge of a request's overrides stays short work for the scheduler.
MAX_OVERRIDES = 256


def apply_overrides(fields: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any] | list[FieldError]:
    """A spec's `fields` (as builtins) with `overrides` applied, or what is wrong with them (nothing is applied)."""
    if len(overrides) > MAX_OVERRIDES:
        return [FieldError(field="(overrides)", message=f"are {len(overrides)}, more than {MAX_OVERRIDES}",
                           hint="set a whole field rather than each of its entries")]
    errors = [error for key in overrides if (error := _path_error(key)) is not None]
    if errors:
        return errors
    merged = dict(fields)
    # The mappings of the merge's own, each made once and then changed in place (the given fields never are).
    own: dict[int, dict[str, Any]] = {id(merged): merged}
    for key, value in overrides.items():
        *outer, last = key.split(".")
        node: dict[str, Any] = merged
        for depth, part in enumerate(outer):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                where = ".".join(outer[:depth + 1])
                return [FieldError(field=key, message=f"{where} holds a {_kind(child)}, not fields to set one of",
                                   hint=f"set the whole of {where} instead")]
            elif id(child) not in own:
                child = dict(child)
            own[id(child)] = child
            node[part] = child
            node = child
        node[last] = value
    return merged


def _path_error(key: str) -> FieldError | None:
    parts = key.split(".")
    if not all(parts):
        return FieldError(field=key or "(empty)", message="is not a field or a dotted path to one",
                          hint="write a field (nodes) or a path into one (checkpoint_resume.max_resumes)")
    if len(parts) > MAX_PATH_PARTS:
        return FieldError(field=key[:200], message=f"is a path of {len(parts)} names, deeper than any field of a job "
                          "spec", hint="write a field (nodes) or a path into one (checkpoint_resume.max_resumes)")
    if parts[0] not in JobSpec.__struct_fields__:
        return FieldError(field=key, message="is not a known field", hint="check its spelling against docs/jobs.md")
    return None


def _kind(value: object) -> str:
    return "list" if isinstance(value, list) else "value"


def overridden_document(data: bytes, overrides: Mapping[str, Any], *, yaml: bool = False) -> bytes:
    """A spec document (YAML or JSON) with `overrides` applied, as YAML for `decode_spec(..., yaml=True)` to check
    whole as it checks the file alone (YAML keeps what JSON could not hold: a date, a key read as a boolean);
    SpecError when the document is not a mapping of fields or an override cannot apply."""
    check_document_size(data)
    try:
        fields = msgspec.yaml.decode(data) if yaml else msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise SpecError([FieldError(field="(document)", message=f"is not valid: {exc}")]) from None
    if not isinstance(fields, dict):
        raise SpecError([FieldError(field="(document)", message="is not a mapping of a job spec's fields")])
    merged = apply_overrides(fields, overrides)
    if isinstance(merged, list):
        raise SpecError(merged)
    return msgspec.yaml.encode(merged)
