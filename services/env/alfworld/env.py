"""ALFWorld as a gymnasium env in the GTR setting (gtr-method.md §6).

The agent writes free text; the command is the admissible command found in the text after
``"action":`` (a random admissible command, flagged illegal, when none is). Reward per step:
50·won + goal-condition success rate − 1 for an illegal action. Episodes end on a win, after
``max_steps`` steps, or (GTR) after ``max_actions`` actions or the same command
``max_repeats`` times in a row, which also sets the step's reward to ``truncation_penalty``.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from pydantic import BaseModel, ConfigDict, Field

from services.env.alfworld.engine import Snapshot, TextWorldEngine
from services.env.alfworld.games import find_games
from services.env.alfworld.prompts import agent_prompt
from services.env.alfworld.render import render_state
from services.env.alfworld.scene import build_state, task_text
from services.env.parser import ParsedOutput, parse_output

OUTPUT_KEYS = ("thoughts", "action")


class AlfWorldOptions(BaseModel):
    """`EnvConfig.options` of the alfworld task."""

    model_config = ConfigDict(extra="forbid")
    games: str | list[str] | None = Field(
        None, description="Folder(s) of games; see docs/alfworld.md"
    )
    observation: Literal["image", "image+text", "text"] = Field(
        "image", description="What the prompt adds to the image"
    )
    expert: Literal["handcoded", "planner"] = Field(
        "handcoded", description="Source of the expert plan"
    )
    backend: Literal["text", "thor"] = Field(
        "text", description="text = TextWorld + schematic image; thor = AI2-THOR frames"
    )
    max_actions: int = Field(40, ge=1, le=1000, description="GTR truncation: actions per episode")
    max_repeats: int = Field(5, ge=2, le=1000, description="GTR truncation: same command in a row")
    truncation_penalty: float = Field(-3.0, description="Reward of a GTR-truncated step")
    history: int = Field(40, ge=0, le=1000, description="Previous actions shown in the prompt")


def match_command(text: str, admissible: list[str]) -> str | None:
    """The admissible command named in the text after '"action":' (else its last 30 chars).

    Of several matches the longest wins, so 'go to cabinet 10' is never read as 'cabinet 1'.
    """
    low = text.lower()
    at = low.find('"action":')
    tail = low[at + len('"action":') :] if at >= 0 else low[-30:]
    found = [c for c in admissible if c.lower() in tail]
    return max(found, key=len) if found else None


class AlfWorldEnv(gym.Env[np.ndarray, Any]):
    """One ALFWorld game per episode, drawn from `games` with the env's seeded generator."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        options: AlfWorldOptions,
        image_size: int = 300,
        max_steps: int = 50,
        invalid_action: str = "random",
        seed: int | None = None,
        engine: Any = None,
    ) -> None:
        self.options = options
        self.games = find_games(options.games)
        self.image_size = image_size
        self.max_steps = max_steps
        self.invalid_action = invalid_action
        self.engine = engine or TextWorldEngine(options.expert, seed or 0)
        self.observation_space = spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.action_space = spaces.Text(max_length=200)
        self._seed = seed
        self._snap: Snapshot | None = None
        self._task = ""
        self._history: list[str] = []  # the commands executed this episode
        self._steps = 0  # steps taken, no-ops included
        self._repeats = 0
        self._state: dict[str, Any] | None = None
        self._pending_illegal: int | None = None

    # ---- the interface every gtr env offers ------------------------------------------------
    @property
    def action_names(self) -> list[str]:
        return self._require().admissible

    def prompt(self) -> str:
        return agent_prompt(
            self.state(),
            self._history[-self.options.history :] if self.options.history else [],
            self.options.observation,
            self._require().feedback,
        )

    def state(self) -> dict[str, Any]:
        if self._state is None:
            snap = self._require()
            task = self.engine.task
            if task is None:
                raise RuntimeError("call reset() before using the ALFWorld env")
            done, total = self.engine.progress(snap)
            self._state = build_state(task, self._task, snap.facts, snap.front) | {
                "game": task.game_file,
                "admissible": list(snap.admissible),
                "expert_plan": list(snap.expert_plan),
                "goal_progress": [done, total],
                "goal_condition_success_rate": done / total,
                "won": snap.won,
                "feedback": snap.feedback,
                "history": list(self._history),
                "step": self._steps,
            }
        return self._state

    def parse(self, text: str) -> ParsedOutput:
        """The shared JSON reading, plus ALFWorld's command matching when no value matched."""
        return parse_with_commands(text, self.action_names)

    def random_action(self) -> int:
        """A random admissible command for an unreadable output; the next step counts it illegal."""
        self._pending_illegal = int(self.np_random.integers(len(self.action_names)))
        return self._pending_illegal

    def noop(self) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """A penalised no-op for an unreadable output: the state stays, the step counts."""
        return self.step(None)

    # ---- gymnasium -------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=self._seed if seed is None and self._snap is None else seed)
        game = (options or {}).get("game")
        if game is None:
            game = self.games[int(self.np_random.integers(len(self.games)))]
        elif isinstance(game, int):
            game = self.games[game]
        self.engine.load(str(game))
        self._snap = self.engine.reset()
        self._task = task_text(self._snap.feedback)
        self._history, self._steps, self._repeats = [], 0, 0
        self._state, self._pending_illegal = None, None
        return self.render(), self._info(legal=True, command=None, truncation=None)

    def step(
        self, action: int | str | None
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Execute an index into action_names, a command, or free text (None: a no-op)."""
        pending, self._pending_illegal = self._pending_illegal, None
        command, legal = self._resolve(action) if action is not None else (None, False)
        legal = legal and not (pending is not None and action == pending)
        self._steps += 1
        if command is not None:
            repeated = self._repeats > 0 and self._history[-1] == command
            self._repeats = self._repeats + 1 if repeated else 1
            self._snap = self.engine.step(command)
            self._history.append(command)
        else:  # a no-op: nothing happens, the step still counts
            self._repeats = 0
        self._state = None
        state = self.state()
        won = bool(state["won"])
        reward = 50.0 * won + state["goal_condition_success_rate"] - (0.0 if legal else 1.0)
        truncation = None if won else self._truncation()
        if truncation in ("max_actions", "repeats"):
            reward = self.options.truncation_penalty
        info = self._info(legal=legal, command=command, truncation=truncation)
        return self.render(), reward, won, truncation is not None, info

    def render(self) -> np.ndarray:
        return render_state(self.state(), self.image_size)

    def display(self, size: int) -> np.ndarray:
        """The same picture at ``size`` px, where labels can be read."""
        return render_state(self.state(), size)

    def close(self) -> None:
        self.engine.close()

    # ---- helpers ---------------------------------------------------------------------------
    def _require(self) -> Snapshot:
        if self._snap is None:
            raise RuntimeError("call reset() before using the ALFWorld env")
        return self._snap

    def _resolve(self, action: int | str) -> tuple[str | None, bool]:
        admissible = self.action_names
        if isinstance(action, int | np.integer):
            if not 0 <= int(action) < len(admissible):
                raise ValueError(f"action {action!r} is not in 0..{len(admissible) - 1}")
            return admissible[int(action)], True
        command = action if action in admissible else match_command(str(action), admissible)
        if command is not None:
            return command, True
        if self.invalid_action == "noop":
            return None, False
        return admissible[int(self.np_random.integers(len(admissible)))], False

    def _truncation(self) -> str | None:
        steps = self._steps
        if self._repeats >= self.options.max_repeats:
            return "repeats"
        if steps >= self.options.max_actions:
            return "max_actions"
        if steps >= self.max_steps:
            return "max_steps"
        return None

    def _info(self, legal: bool, command: str | None, truncation: str | None) -> dict[str, Any]:
        state = self.state()
        return {
            "state": state,
            "won": state["won"],
            "success": state["won"],
            "legal": legal,
            "command": command,
            "goal_condition_success_rate": state["goal_condition_success_rate"],
            "subtask": state["subtask"],
            "truncation": truncation,
            "synthetic": state["synthetic"],
            "benchmark": state.get("benchmark", False),
        }


def parse_with_commands(text: str, commands: list[str]) -> ParsedOutput:
    """Parse an output against a state's admissible commands (no live env needed)."""
    parsed = parse_output(text, commands, OUTPUT_KEYS)
    if parsed.action is None and isinstance(text, str):
        command = match_command(text, commands)
        if command is not None:
            parsed.action, parsed.action_valid = commands.index(command), True
    return parsed
