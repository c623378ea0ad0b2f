"""The overrides of `trainyard clone` (O1): `--set key=value` options and an overrides file.

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


def _check_key(key: str, origin: str) -> None:
    fields = spec_fields()
    if key in fields:
        return
    close = difflib.get_close_matches(key, fields, n=1)
    raise OverrideError(f"{origin}: a job spec has no field {key!r}",
                        (f"did you mean {close[0]!r}? " if close else "") + "docs/jobs.md lists the fields")


def _keeps_text(field_type: msgspec_inspect.Type, value: object) -> bool:
    """Whether a YAML scalar that is not text (`535.104`, `2024`, `yes`, `2024-01-01`) is meant as the text
    typed: the field takes text and no number, boolean or date."""
    types = field_type.types if isinstance(field_type, msgspec_inspect.UnionType) else (field_type,)
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
    """`--set key=value` options as top-level spec overrides; values are YAML (`2`, `[cpu-2]`, `{name: x}`).

    Only top-level fields can be replaced (CloneJob replaces whole fields), so `a.b=c` is refused with
    the equivalent whole-field form rather than silently dropping a's other settings.
    """
    import yaml

    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OverrideError(f"--set {item!r} is not key=value",
                                "write it as --set nodes=2, --set 'flavors=[cpu-2]' or --set priority=urgent")
        if "." in key:
            top, *rest = key.split(".")
            nested = raw.strip() or "..."
            for part in reversed(rest):
                nested = f"{{{part}: {nested}}}"
            raise OverrideError(f"--set {key}: nested keys are not supported; only top-level fields of the spec "
                                "can be set",
                                f"set the whole field instead, e.g. --set '{top}={nested}' (this replaces all of "
                                f"{top}: repeat the parts to keep), or put it in an overrides file (-f)")
        _check_key(key, f"--set {key}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = str(getattr(exc, "problem", None) or exc)
            raise OverrideError(f"--set {key}: the value {raw!r} is not valid YAML ({problem})",
                                f"quote the whole option in the shell, e.g. --set '{key}=[a, b]'") from None
        overrides[key] = raw.strip() if _keeps_text(spec_fields()[key], value) else value
    return overrides


def read_overrides_file(path: Path) -> dict[str, Any]:
    """An overrides file: a YAML (or JSON) mapping of top-level spec fields to their new values."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise OverrideError(f"{path} is not valid YAML ({exc})", "fix the file; it holds top-level fields of a "
                            "job spec, e.g. `nodes: 2`") from None
    if document is None:
        return {}
    if not isinstance(document, dict) or not all(isinstance(key, str) for key in document):
        raise OverrideError(f"{path} is not a mapping of field names to values",
                            "write top-level fields of a job spec, one per line, e.g. `nodes: 2`")
    for key in document:
        _check_key(key, f"{path}: {key}")
    return document


def clone_overrides(file: Path | None, items: Sequence[str], name: str | None) -> dict[str, Any]:
    """The overrides of `trainyard clone`: the file's, then each --set, then --name (later ones win)."""
    overrides = read_overrides_file(file) if file is not None else {}
    overrides.update(parse_set_options(items))
    if name is not None:
        overrides["name"] = name
    return overrides
