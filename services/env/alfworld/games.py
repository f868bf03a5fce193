"""Finding ALFWorld games on disk and reading their task (no alfworld import needed)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
SYNTHETIC_MARKER = "SYNTHETIC"
# ALFRED names each recorded trajectory trial_T<date>_<time>_<id>; derived games (the sample's
# goal swaps: trial_variant_N) and synthetic ones do not, so they are never benchmark games.
_BENCHMARK_TRIAL = re.compile(r"trial_T\d{8}_\d{6}_\d+")

# ALFWorld task types (alfworld.agents.environment TASK_TYPES) -> the subtask names of the papers.
SUBTASKS: dict[str, str] = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick_two",
}

HOW_TO_GET_GAMES = (
    # The pointer to the docs first: services cut long error texts to a short excerpt.
    "ALFWorld needs games (docs/alfworld.md): set env.options.games to a folder (or list of "
    "folders) holding <task>/trial_*/{game.tw-pddl,traj_data.json}. Full data set: `pip install "
    "'gtr-lab[alfworld]' && export ALFWORLD_DATA=~/alfworld && alfworld-download` then games = "
    "'$ALFWORLD_DATA/json_2.1.1/train'; offline: `gtr alfworld make-games OUT --n 20` "
    "(synthetic, never an ALFWorld score). To play: `gtr env play alfworld --games DIR --expert`."
)


class GamesError(ValueError):
    """Games are missing or malformed; the message says how to fix it."""


@dataclass(frozen=True)
class GameTask:
    """The task of one game, read from the traj_data.json beside its game file."""

    game_file: str
    task_type: str
    object_target: str
    parent_target: str
    toggle_target: str
    synthetic: bool

    @property
    def benchmark(self) -> bool:
        """A game of ALFWorld's data set: a recorded ALFRED trial, not derived nor synthetic."""
        trial = Path(self.game_file).parent.name
        return not self.synthetic and bool(_BENCHMARK_TRIAL.fullmatch(trial))

    @property
    def subtask(self) -> str:
        return SUBTASKS[self.task_type]


def load_task(game_file: str | Path) -> GameTask:
    """Read the task type and targets of a game (ALFWorld keeps them in traj_data.json)."""
    game_dir = Path(game_file).parent
    traj_path = game_dir / TRAJ_FILE
    try:
        traj: dict[str, Any] = json.loads(traj_path.read_text())
        params = traj["pddl_params"]
        task_type = traj["task_type"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise GamesError(f"{traj_path}: unreadable traj_data.json ({e})") from e
    if task_type not in SUBTASKS:
        raise GamesError(f"{traj_path}: unsupported task_type {task_type!r}")
    return GameTask(
        game_file=str(game_file),
        task_type=task_type,
        object_target=params.get("object_target", "").lower(),
        parent_target=params.get("parent_target", "").lower(),
        toggle_target=params.get("toggle_target", "").lower(),
        synthetic=bool(traj.get("synthetic")) or (game_dir / SYNTHETIC_MARKER).exists(),
    )


def _solvable(game_file: Path) -> bool:
    try:
        return bool(json.loads(game_file.read_text()).get("solvable"))
    except (OSError, json.JSONDecodeError):
        return False


def find_games(spec: str | Path | list[str] | list[Path] | None) -> list[str]:
    """All solvable games under the given folder(s), sorted; raises GamesError with a how-to."""
    if not spec:
        raise GamesError(HOW_TO_GET_GAMES)
    roots = [spec] if isinstance(spec, str | Path) else list(spec)
    games: list[str] = []
    for root in roots:
        path = Path(os.path.expandvars(os.path.expanduser(str(root))))
        if not path.exists():
            raise GamesError(f"games folder {path} does not exist. {HOW_TO_GET_GAMES}")
        candidates = [path] if path.name == GAME_FILE else sorted(path.rglob(GAME_FILE))
        for game in candidates:
            # Same filter as AlfredTWEnv: movable/sliced tasks are unsupported upstream.
            if "movable" in str(game) or "Sliced" in str(game):
                continue
            if (game.parent / TRAJ_FILE).exists() and _solvable(game):
                games.append(str(game))
    if not games:
        raise GamesError(f"no solvable games under {roots}. {HOW_TO_GET_GAMES}")
    return games
