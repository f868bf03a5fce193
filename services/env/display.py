"""Frames for people (the picture a recorded step's page shows), drawn when someone looks.

Drawing and PNG-encoding a 320 px frame at every recorded step cost a rollout 3–15× its env
time (docs/benchmarks.md, "Display frames"), for pictures few steps ever get looked at. Every
gym_cards frame and ALFWorld's schematic picture are functions of the step's stored state, so
the step page draws its frame from that state on demand (`services/api/display.py`) and the
rollout draws none. Only frames no state can redraw (ALFWorld's THOR camera) are still drawn
and stored while the run records its steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.env.registry import CARD_ENVS

DISPLAY_SIZE = 320  # px of the frame people see on a recorded step: the page shows it at 340


def display_size(env: dict[str, Any]) -> int:
    """The side of a run's frames for people from its ``env`` config (a dict, as stored);
    0 when the run asked for none or the model's input is no smaller."""
    size = env.get("display_size")
    size = DISPLAY_SIZE if size is None else int(size)
    return size if size > int(env.get("image_size", 300)) else 0


def redrawable(task: str, env: dict[str, Any]) -> bool:
    """Whether a step's frame can be drawn again from its stored state (not THOR's camera)."""
    if task == "alfworld":
        return (env.get("options") or {}).get("backend", "text") == "text"
    return task in CARD_ENVS


def record_time_size(task: str, env: dict[str, Any]) -> int:
    """The display size an env pool must draw at while a run records: only for frames that
    cannot be redrawn later; 0 (none) for the rest."""
    return 0 if redrawable(task, env) else display_size(env)


def draw_state(
    task: str, env: dict[str, Any], state: dict[str, Any], size: int
) -> np.ndarray | None:
    """The frame of a recorded step's ``state`` at ``size`` px, or None when the state cannot
    give it (THOR frames, a state written by hand without the drawing's keys)."""
    if not redrawable(task, env):
        return None
    try:
        if task == "alfworld":
            from services.env.alfworld.render import render_state

            return render_state(state, size)
        return CARD_ENVS[task].draw_state(state, size)
    except (KeyError, TypeError, ValueError, IndexError):
        return None
