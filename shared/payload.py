"""What a stored JSON value may hold: only what PostgreSQL keeps and every reader serves back.

A lone UTF-16 surrogate (``"\\ud800"``) is valid in a Python str but not in UTF-8, NaN and
Infinity are not JSON, and a value nested hundreds deep overflows recursive readers. Each of
these was once saved and then broke every page listing it, so they are refused (422) before
anything is written. Pure functions: no torch, no database.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32  # containers inside containers; run configs need 3
MAX_FREE_FORM_BYTES = 64 * 1024  # a free-form dict (env.options, corrector params) as JSON


class UnstorableValue(ValueError):
    """The value cannot be stored and served back; the message names where and why."""


def check_storable(value: Any, where: str = "value", max_depth: int = MAX_DEPTH) -> None:
    """Raises UnstorableValue at the first lone surrogate, NaN/Infinity or too-deep nesting.

    Iterative (an explicit stack), so a hostile depth cannot overflow this check itself.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise UnstorableValue(f"{_short(path)}: NaN and Infinity are not allowed")
        elif isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                raise UnstorableValue(f"{_short(path)}: nested deeper than {max_depth} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, f"{path} (a key)")
                stack.append((child, f"{path}.{key}", depth + 1))


def check_free_form(value: Any, where: str, max_bytes: int = MAX_FREE_FORM_BYTES) -> Any:
    """`check_storable` plus a size cap on the value's JSON text; returns the value."""
    check_storable(value, where)
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > max_bytes:
        raise UnstorableValue(f"{where}: {size} bytes of JSON; the limit is {max_bytes}")
    return value


def _short(path: str) -> str:
    return path if len(path) <= 120 else path[:117] + "..."


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnstorableValue(f"{_short(path)}: not valid Unicode (a lone surrogate)") from e
    if "\x00" in text:
        raise UnstorableValue(f"{_short(path)}: the NUL character is not allowed")
