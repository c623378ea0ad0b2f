"""The overrides of `trainyard clone` (O1) and `trainyard submit`: `--set key=value` options and clone's overrides
file.

Values are YAML; PyYAML is imported only when one is read.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any

from msgspec import inspect as msgspec_inspect

from libs.contracts.jobspec import JobSpec


class OverrideError(ValueError):
    """A --set or overrides file the CLI refuses before anything is sent; `hint` says how to write it."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@cache
def spec_fields() -> dict[str, msgspec_inspect.Type]:
    """The top-level fields of a job spec and their types."""
    info = msgspec_inspect.type_info(JobSpec)
    assert isinstance(info, msgspec_inspect.StructType)
    return {field.name: field.type for field in info.fields}


def field_type(key: str, origin: str) -> msgspec_inspect.Type:
    """The type of the field `key` names: a top-level field of the spec (`nodes`) or a dotted path into a field
    that holds fields or a mapping (`checkpoint_resume.max_resumes`, `env.SEED`)."""
    top, *rest = key.split(".")
    if not all((top, *rest)):
        raise OverrideError(f"{origin}: {key!r} is not a field or a dotted path to one",
                            "write a field (nodes) or a path into one (checkpoint_resume.max_resumes)")
    found = _named(top, spec_fields(), origin, "a job spec")
    walked = top
    for part in rest:
        inner = _holding(found)
        if isinstance(inner, msgspec_inspect.StructType):
            found = _named(part, {field.name: field.type for field in inner.fields}, origin, walked)
        elif isinstance(inner, msgspec_inspect.DictType):
            found = inner.value_type
        else:
            raise OverrideError(f"{origin}: {walked} holds no fields to set one of",
                                f"set the whole of {walked} instead, e.g. --set '{walked}=...'")
        walked = f"{walked}.{part}"
    return found


def _named(name: str, fields: dict[str, msgspec_inspect.Type], origin: str, owner: str) -> msgspec_inspect.Type:
    if name in fields:
        return fields[name]
    close = difflib.get_close_matches(name, fields, n=1)
    raise OverrideError(f"{origin}: {owner} has no field {name!r}",
                        (f"did you mean {close[0]!r}? " if close else "") + "docs/jobs.md lists the fields")


def _holding(found: msgspec_inspect.Type) -> msgspec_inspect.Type | None:
    """What a field holds fields of: its struct or mapping type, also where it may be null."""
    return next((t for t in _alternatives(found)
                 if isinstance(t, msgspec_inspect.StructType | msgspec_inspect.DictType)), None)


def _alternatives(found: msgspec_inspect.Type) -> list[msgspec_inspect.Type]:
    """The types a field may hold: a union's members, each with its constraints (a name's pattern) taken off."""
    types = found.types if isinstance(found, msgspec_inspect.UnionType) else (found,)
    return [t.type if isinstance(t, msgspec_inspect.Metadata) else t for t in types]


def _put(overrides: dict[str, Any], key: str, value: Any) -> None:
    """Set one override after the others, so that it wins: a whole field drops the paths into it set before."""
    for earlier in [k for k in overrides if k == key or k.startswith(f"{key}.")]:
        del overrides[earlier]
    overrides[key] = value


def _keeps_text(field_type: msgspec_inspect.Type, value: object) -> bool:
    """Whether a YAML scalar that is not text (`535.104`, `2024`, `yes`, `2024-01-01`) is meant as the text
    typed: the field takes text and no number, boolean or date."""
    types = _alternatives(field_type)
    takes_text = any(isinstance(t, msgspec_inspect.StrType)
                     or (isinstance(t, msgspec_inspect.LiteralType) and any(isinstance(v, str) for v in t.values))
                     for t in types)
    if not takes_text:
        return False
    if isinstance(value, bool):
        return not any(isinstance(t, msgspec_inspect.BoolType) for t in types)
    if isinstance(value, int | float):
        return not any(isinstance(t, msgspec_inspect.IntType | msgspec_inspect.FloatType) for t in types)
    return isinstance(value, date)


def parse_set_options(items: Sequence[str]) -> dict[str, Any]:
    """`--set key=value` options as spec overrides, in order (a later one wins); values are YAML (`2`, `[cpu-2]`,
    `{name: x}`). A key is a top-level field, replaced whole, or a dotted path into one (`env.SEED=7`,
    `checkpoint_resume.max_resumes=5`), which sets that entry and keeps the field's others."""
    import yaml

    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OverrideError(f"--set {item!r} is not key=value",
                                "write it as --set nodes=2, --set 'flavors=[cpu-2]' or --set env.SEED=7")
        kind = field_type(key, f"--set {key}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = str(getattr(exc, "problem", None) or exc)
            raise OverrideError(f"--set {key}: the value {raw!r} is not valid YAML ({problem})",
                                f"quote the whole option in the shell, e.g. --set '{key}=[a, b]'") from None
        _put(overrides, key, raw.strip() if _keeps_text(kind, value) else value)
    return overrides


def read_overrides_file(path: Path) -> dict[str, Any]:
    """An overrides file: a YAML (or JSON) mapping of spec fields (or dotted paths into them) to their new values."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise OverrideError(f"{path} is not valid YAML ({exc})", "fix the file; it holds fields of a "
                            "job spec, e.g. `nodes: 2`") from None
    if document is None:
        return {}
    if not isinstance(document, dict) or not all(isinstance(key, str) for key in document):
        raise OverrideError(f"{path} is not a mapping of field names to values",
                            "write fields of a job spec, one per line, e.g. `nodes: 2` or `env.SEED: '7'`")
    for key in document:
        field_type(key, f"{path}: {key}")
    return document


def clone_overrides(file: Path | None, items: Sequence[str], name: str | None) -> dict[str, Any]:
    """The overrides of `trainyard clone`: the file's, then each --set, then --name (later ones win)."""
    overrides: dict[str, Any] = {}
    for key, value in [*(read_overrides_file(file) if file is not None else {}).items(),
                       *parse_set_options(items).items(), *([("name", name)] if name is not None else [])]:
        _put(overrides, key, value)
    return overrides
