"""Patterns that must match a whole string.

Python's `$` also matches just before a final newline, so `^job-[0-9a-f]{12}$` passes "job-0123456789ab\\n": an id
with a newline would break the NATS subject and the paths it is put in. Every whole-string pattern of the
contracts ends with `\\Z` instead, which matches only at the very end. JSON Schema's patterns (ECMA-262) have no
`\\Z`, and there `$` already means the very end: `for_json_schema` turns one into the other in the documents made
from the contracts (docs/schemas, the gateway's OpenAPI document).
"""

from __future__ import annotations

from typing import Any

END = r"\Z"


def for_json_schema(value: Any) -> Any:
    """`value` (a JSON Schema, or part of one) with each pattern's final `\\Z` written as JSON Schema's `$`."""
    if isinstance(value, dict):
        return {key: (item[: -len(END)] + "$" if key == "pattern" and isinstance(item, str) and item.endswith(END)
                      else for_json_schema(item)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [for_json_schema(item) for item in value]
    return value
