"""The privileged, JSON-able state of an ALFWorld game, read from the engine's facts."""

from __future__ import annotations

import re
from typing import Any

from services.env.alfworld.games import GameTask
from services.env.alfworld.goals import Fact

_TASK = re.compile(r"Your task is to:\s*(.+)", re.IGNORECASE)
_OBJECT_STATES = (
    ("ishot", "hot"),
    ("iscool", "cold"),
    ("isclean", "clean"),
    ("istoggled", "on"),
    ("issliced", "sliced"),
)


def task_text(first_feedback: str) -> str:
    """The task sentence of the game's opening text."""
    found = _TASK.search(first_feedback)
    return found.group(1).strip().rstrip(".") if found else ""


def _natural(name: str) -> tuple[str, int]:
    base, _, num = name.rpartition(" ")
    return (base, int(num)) if num.isdigit() else (name, 0)


def build_state(
    task: GameTask, task_sentence: str, facts: list[Fact], front: str | None
) -> dict[str, Any]:
    """Location, receptacle in front, what is visible and held, and the object states."""
    by: dict[str, list[tuple[str, ...]]] = {}
    for name, args in facts:
        by.setdefault(name, []).append(args)
    location = next((a[1] for a in by.get("atlocation", [])), "")
    receptacles = sorted({a[0] for a in by.get("receptacletype", [])}, key=_natural)
    openable = {a[0] for a in by.get("openable", [])}
    opened = {a[0] for a in by.get("opened", [])}
    holding = next((a[1] for a in by.get("holds", [])), None)
    front_open: bool | None = (front in opened) if front in openable else None
    visible: list[str] = []
    if front is not None and front_open is not False:
        visible = sorted((a[0] for a in by.get("inreceptacle", []) if a[1] == front), key=_natural)
    flags: dict[str, list[str]] = {}
    for pred, word in _OBJECT_STATES:
        for obj, *_ in by.get(pred, []):
            if obj in visible or obj == holding:
                flags.setdefault(obj, []).append(word)
    return {
        "task": task_sentence,
        "task_type": task.task_type,
        "subtask": task.subtask,
        "targets": {
            "object": task.object_target,
            "receptacle": task.parent_target,
            "toggle": task.toggle_target,
        },
        "synthetic": task.synthetic,
        "benchmark": task.benchmark,  # False for synthetic and derived (goal-swap) games
        "location": location,
        "front": front,
        "front_open": front_open,
        "visible": visible,
        "holding": holding,
        "object_states": {k: sorted(v) for k, v in sorted(flags.items())},
        "receptacles": receptacles,
    }
