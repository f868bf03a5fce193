"""Paths in a run config file are relative to that file, never to the working directory.

A config names files (ALFWorld games, a model, a checkpoint). Read from TOML, each such path has
``~`` and ``$VARS`` expanded and, when still relative, is joined to the config file's folder, so
`gtr train path/to/run.toml` means the same run from any folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# (section, key) of every path field; env.options.games may be a list of folders.
PATH_FIELDS: tuple[tuple[str, ...], ...] = (
    ("env", "options", "games"),
    ("model", "path"),
    ("init", "checkpoint"),
)


def resolve_path(value: str, base: Path) -> str:
    """``value`` with ~ and $VARS expanded, made absolute against ``base`` if relative."""
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    return str(path if path.is_absolute() else (base / path).resolve())


def resolve_config_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """The raw config with every path field resolved against ``base`` (in place, returned)."""
    for *parents, key in PATH_FIELDS:
        node: Any = raw
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or key not in node:
            continue
        value = node[key]
        if isinstance(value, str) and value:
            node[key] = resolve_path(value, base)
        elif isinstance(value, list):
            node[key] = [resolve_path(v, base) if isinstance(v, str) else v for v in value]
    return raw
