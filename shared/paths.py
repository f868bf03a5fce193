"""Paths a caller names (a run's model and checkpoint, a checkpoint the policy service loads)
are confined to configured roots; whether a path is absent or not allowed is never told apart.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

CHECKPOINT_NOT_FOUND = (
    "no policy checkpoint (policy.json) with that id or path in the checkpoint store"
)
MODEL_NOT_FOUND = "no model (config.json) at that path under the model folders"
GAMES_NOT_FOUND = (
    "no ALFWorld games folder at that path under the games folders (data_dir/games, "
    "GTR_GAMES_ROOTS)"
)
MAX_GAMES_FOLDERS = 64
_RUN_DIR = re.compile(r"^run-(\d+)$")


def confined(text: str, roots: Sequence[Path], marker: str | None = None) -> Path | None:
    """The resolved folder `text` names, if it lies under one of `roots` (a relative `text` is
    taken under the first root: an id in the store) and holds `marker`; else None.

    Symlinks and `..` are resolved before the check, so neither leads out of a root.
    """
    if not text or len(text) > 1000 or not roots:
        return None
    try:
        given = Path(text)
        path = (given if given.is_absolute() else Path(roots[0]) / given).resolve()
        if not any(path.is_relative_to(Path(r).resolve()) for r in roots):
            return None
        if marker is not None and not (path / marker).is_file():
            return None
    except (OSError, ValueError):  # a name too long, a NUL byte, a loop of links
        return None
    return path


def confined_games(value: object, roots: Sequence[Path]) -> str | list[str] | None:
    """ALFWorld's ``env.options.games`` (a folder, or a list of them, or a game file, each
    under one of `roots`) resolved; None when any is outside, absent or not a path."""
    folders = value if isinstance(value, list) else [value]
    if not folders or len(folders) > MAX_GAMES_FOLDERS:
        return None
    resolved = []
    for folder in folders:
        path = confined(folder, roots) if isinstance(folder, str) else None
        try:
            if path is None or not path.exists():
                return None
        except OSError:  # a name too long
            return None
        resolved.append(str(path))
    return resolved if isinstance(value, list) else resolved[0]


def run_of_checkpoint(path: Path, store: Path) -> int | None:
    """The run whose checkpoint `path` is (``<store>/run-<id>/...``), or None outside the store."""
    try:
        rel = path.resolve().relative_to(store.resolve())
    except (OSError, ValueError):
        return None
    match = _RUN_DIR.match(rel.parts[0]) if rel.parts else None
    return int(match.group(1)) if match else None
