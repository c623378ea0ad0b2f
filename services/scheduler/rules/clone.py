"""O1: a cloned job's spec, the source's with the caller's overrides applied.

An override's key is a top-level field of the spec (`nodes`), replaced whole, or a dotted path into a field that
holds a mapping (`checkpoint_resume.max_resumes`, `env.SEED`), which replaces that one entry and keeps its
siblings. Overrides apply in their order, so a later one wins: a whole field after a path into it replaces what the
path set. A path through an absent or null field makes it a mapping; the merged spec is then decoded strictly, which
refuses a field the spec does not have at any depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libs.contracts.jobspec import FieldError, JobSpec


def cloned_fields(source: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any] | list[FieldError]:
    """The spec's fields (as builtins) with `overrides` applied, or what is wrong with them (nothing is applied)."""
    errors = [error for key in overrides if (error := _path_error(key)) is not None]
    if errors:
        return errors
    merged = dict(source)
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
            node[part] = child = dict(child)  # a copy: the source's own mapping is never changed
            node = child
        node[last] = value
    return merged


def _path_error(key: str) -> FieldError | None:
    parts = key.split(".")
    if not all(parts):
        return FieldError(field=key or "(empty)", message="is not a field or a dotted path to one",
                          hint="write a field (nodes) or a path into one (checkpoint_resume.max_resumes)")
    if parts[0] not in JobSpec.__struct_fields__:
        return FieldError(field=key, message="is not a known field", hint="check its spelling against docs/jobs.md")
    return None


def _kind(value: object) -> str:
    return "list" if isinstance(value, list) else "value"
