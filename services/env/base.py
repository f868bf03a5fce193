"""What every gym_cards environment shares: config, seeding, the step limit, parsing, no-ops.

The seed given at construction seeds the first ``reset()``; later resets continue the same random
stream (gymnasium's convention), so a session replays exactly from its seed. ``reset(options=...)``
can fix a deal (see each task), for hand-made scenarios.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from services.env.parser import ParsedOutput, parse_output
from services.env.prompts import OUTPUT_KEYS
from shared.schemas import EnvConfig

INVALID_PENALTY = -1.0  # the penalised no-op's reward (tiny-ezpoints.md: "a -1 no-op")


class GymCardsEnv(gym.Env[np.ndarray, Any]):
    """Base class: subclasses set ``task``, ``action_names`` and implement the rules."""

    task: ClassVar[str]
    action_names: list[str]
    default_max_steps: ClassVar[int] = 300  # the reference registers a TimeLimit of 300
    points: ClassVar[bool] = False  # the parser reads '10' first on the points games
    # The stall penalty: the reward added when the time limit ends an episode the agent could
    # have ended itself and did not (a formula never submitted, a hand never stood on). Under the
    # reference's TimeLimit of 300 such an episode always ends at -1 (the formula outgrows its
    # limit, the hand busts); a shorter limit must not end it at 0, above a wrong answer's -1.
    # None: the task has no answer to withhold (NumberLine: every move is one).
    stall_penalty: ClassVar[float | None] = None
    metadata = {"render_modes": ["rgb_array"]}  # noqa: RUF012 - gymnasium reads it per class

    def __init__(self, config: EnvConfig | None = None, seed: int | None = None) -> None:
        self.config = config or EnvConfig.model_validate({})
        self.size = self.config.image_size
        self.render_mode = "rgb_array"
        self.action_space = spaces.Discrete(len(self.action_names))
        self.observation_space = spaces.Box(0, 255, (self.size, self.size, 3), np.uint8)
        self.max_steps = self.config.max_episode_steps or self.default_max_steps
        self.output_keys = OUTPUT_KEYS[self.task]
        self._seed = seed
        self._seeded = False
        self._aux_rng = np.random.default_rng(None if seed is None else [seed, 1])
        self.elapsed = 0

    # ---- gymnasium API ----------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is None and not self._seeded:
            seed = self._seed
        super().reset(seed=seed)
        if seed is not None:
            self._aux_rng = np.random.default_rng([seed, 1])
        self._seeded = True
        self.elapsed = 0
        self._new_episode(options or {})
        return self.render(), {"state": self.state()}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in 0..{len(self.action_names) - 1}")
        self.elapsed += 1
        reward, terminated, truncated = self._apply(int(action))
        return self._finish_step(reward, terminated, truncated)

    def noop(self) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """A penalised no-op for an unreadable output: the state stays, the step counts."""
        self.elapsed += 1
        return self._finish_step(INVALID_PENALTY, False, False)

    def random_action(self) -> int:
        """A uniformly random legal action (the reference's answer to an unreadable output)."""
        return int(self._aux_rng.integers(len(self.action_names)))

    def render(self) -> np.ndarray:  # type: ignore[override]
        return self._draw()

    def display(self, size: int) -> np.ndarray:
        """The current frame drawn at ``size`` px for people; the same drawing as ``render``."""
        model_size = self.size
        self.size = size
        try:
            return self._draw()
        finally:
            self.size = model_size

    @classmethod
    def draw_state(cls, state: dict[str, Any], size: int) -> np.ndarray:
        """The frame of a recorded ``state()`` drawn at ``size`` px: the picture ``display``
        drew then, so a step's frame for people can be drawn when someone looks at it."""
        raise NotImplementedError

    def _finish_step(
        self, reward: float, terminated: bool, truncated: bool
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not terminated and self.config.early_truncation == "reference" and reward == -1.0:
            truncated = True  # GTR's loop: an env reward of -1 ends the episode
        if not terminated and not truncated and self.elapsed >= self.max_steps:
            truncated = True
            if self.stall_penalty is not None:
                reward += self.stall_penalty  # stalled to the time limit: never scores above -1
        elif not terminated and self.elapsed >= self.max_steps:
            truncated = True
        return self.render(), float(reward), terminated, truncated, {"state": self.state()}

    # ---- the contract every env offers ------------------------------------------------------

    def parse(self, text: str) -> ParsedOutput:
        """Read an agent output against this task's actions and keys."""
        return parse_output(text, self.action_names, self.output_keys, self.points)

    def prompt(self) -> str:
        """The agent-visible text for the current state."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Privileged, JSON-able state (for the oracle, the corrector and the metrics)."""
        raise NotImplementedError

    # ---- the rules, per task ----------------------------------------------------------------

    def _new_episode(self, options: dict[str, Any]) -> None:
        """Deal a new episode; ``options`` may fix it (hand-made scenarios, tests)."""
        raise NotImplementedError

    def _apply(self, action: int) -> tuple[float, bool, bool]:
        """Apply one legal action: (reward, terminated, truncated)."""
        raise NotImplementedError

    def _draw(self) -> np.ndarray:
        raise NotImplementedError
