"""A small TOML writer for run configs (the standard library only reads TOML).

Tables become ``[a.b]`` sections, scalars and lists of scalars are written inline; ``None``
(TOML has no null) is left out, which reads back as the field's default of None; a list holding
one has no TOML form (NoToml)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class NoToml(ValueError):
    """The data has no TOML form that reads back equal."""


def _key(k: str) -> str:
    return k if BARE_KEY.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # A JSON string is a TOML basic string, but for DEL, which TOML wants escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        if any(x is None for x in v):  # dropping it would shift the others: a different list
            raise NoToml("a list holds null, which TOML cannot write")
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        inner = ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items() if x is not None)
        return "{ " + inner + " }" if inner else "{}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps(data: dict[str, Any]) -> str:
    """``data`` as TOML text that ``tomllib.loads`` reads back equal (Nones left out)."""
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if v is not None and not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    lines.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
    for k, v in tables.items():
        _table(v, [*path, k], lines)
