"""NumberLine-v0: move the current number to the target, one step of +-1 at a time."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from services.env import render
from services.env.base import GymCardsEnv
from services.env.prompts import numberline_prompt

MAX_POSITION = 5


class NumberLineEnv(GymCardsEnv):
    """Reference rules: +1 and done on reaching the goal, -1 if the distance did not shrink."""

    task = "numberline"
    action_names = ["-", "+"]
    default_max_steps = 2 * MAX_POSITION  # the reference truncates after 10 steps

    def _new_episode(self, options: dict[str, Any]) -> None:
        """Options: ``current`` and ``target`` (0..5) fix the start."""
        self.current = int(self.np_random.integers(0, MAX_POSITION + 1))
        self.target = int(self.np_random.integers(0, MAX_POSITION + 1))
        if "current" in options or "target" in options:
            self.current = int(options.get("current", self.current))
            self.target = int(options.get("target", self.target))
            if not 0 <= self.current <= MAX_POSITION or not 0 <= self.target <= MAX_POSITION:
                raise ValueError(f"current and target must lie in 0..{MAX_POSITION}")
        if self.current == self.target:
            # The reference's modulus is 5, not 6: the goal never becomes 5 this way.
            self.target = (self.target + 1) % MAX_POSITION

    def _apply(self, action: int) -> tuple[float, bool, bool]:
        before = abs(self.current - self.target)
        if action == 0:
            self.current = max(self.current - 1, 0)
        else:
            self.current = min(self.current + 1, MAX_POSITION)
        after = abs(self.current - self.target)
        if after == 0:
            return 1.0, True, False
        return (-1.0 if after >= before else 0.0), False, False

    def prompt(self) -> str:
        return numberline_prompt()

    def state(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "current": self.current,
            "target": self.target,
            "max_position": MAX_POSITION,
            "steps": self.elapsed,
        }

    def _draw(self) -> np.ndarray:
        return _frame(self.size, self.target, self.current).copy()

    @classmethod
    def draw_state(cls, state: dict[str, Any], size: int) -> np.ndarray:
        return _frame(size, int(state["target"]), int(state["current"])).copy()


@lru_cache(maxsize=512)
def _frame(s: int, target: int, current: int) -> np.ndarray:
    """Only 36 frames exist per size: draw each once."""
    img, draw = render.canvas(s, render.WHITE)
    f = render.fit_font(f"Current: {MAX_POSITION}", int(s * 0.9), int(s * 0.17), bold=True)
    draw.text((s * 0.05, s * 0.2), f"Target: {target}", fill=render.BLACK, font=f)
    draw.text((s * 0.05, s * 0.6), f"Current: {current}", fill=render.BLACK, font=f)
    return render.to_array(img)
