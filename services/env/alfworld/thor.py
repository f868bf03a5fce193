"""ALFWorld on AI2-THOR: real 3-D frames through the same env interface.

Needs `alfworld[vis]` (ai2thor 2.1.0, opencv, torchvision), an X display, the THOR Unity
build (downloaded by ai2thor on first start, about 390 MB) and the full data set's
traj_data.json (scene poses). None of these exist on the offline machines, so this path is
checked for what is missing and raises `ThorUnavailable` saying so (docs/alfworld.md).
THOR's controller gives text feedback but no PDDL facts; the state is read from that text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.env.alfworld.engine import Snapshot
from services.env.alfworld.env import AlfWorldEnv, AlfWorldOptions
from services.env.alfworld.games import GameTask, load_task
from services.env.alfworld.goals import Fact

THOR_BUILD = "thor-201909061227-Linux64"  # the build ai2thor 2.1.0 (alfworld[vis]) downloads


class ThorUnavailable(ImportError):
    """Something the THOR backend needs is missing; the message lists what."""


def thor_missing() -> list[str]:
    """What the THOR backend lacks here (empty when everything is present)."""
    missing = [
        f"python package {m} (pip install 'alfworld[vis]==0.4.2')"
        for m in ("ai2thor", "cv2", "torchvision")
        if importlib.util.find_spec(m) is None
    ]
    display = os.environ.get("DISPLAY")
    if not display:
        missing.append("an X display: DISPLAY is unset (e.g. Xvfb :0 & export DISPLAY=:0)")
    elif (
        shutil.which("xdpyinfo") is None
        or subprocess.run(["xdpyinfo"], capture_output=True, timeout=10).returncode != 0
    ):
        missing.append(f"a reachable X server on DISPLAY={display} (xdpyinfo fails)")
    if not any((Path.home() / ".ai2thor" / "releases").glob(f"{THOR_BUILD}*")):
        missing.append(
            f"the AI2-THOR build ~/.ai2thor/releases/{THOR_BUILD} (ai2thor downloads "
            "it on first start; needs internet)"
        )
    return missing


_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"You pick up the (\w+ \d+) from the (\w+ \d+)"), "take"),
    (re.compile(r"You (?:move|put) the (\w+ \d+) (?:to|in/on) the (\w+ \d+)"), "put"),
    (re.compile(r"You open the (\w+ \d+)"), "open"),
    (re.compile(r"You close the (\w+ \d+)"), "close"),
    (re.compile(r"The (\w+ \d+) is closed"), "closed"),
    (re.compile(r"You heat the (\w+ \d+)"), "ishot"),
    (re.compile(r"You cool the (\w+ \d+)"), "iscool"),
    (re.compile(r"You clean the (\w+ \d+)"), "isclean"),
    (re.compile(r"You turn on the (\w+ \d+)"), "istoggled"),
]
_SEEN = re.compile(r"(?:On the \w+ \d+|In it), you see (.+?)\.(?:\s|$)")
_ITEM = re.compile(r"\b(?:a|an) (\w+ \d+)")


class FeedbackFacts:
    """PDDL-like facts rebuilt from THOR's text feedback (THOR exposes no facts)."""

    def __init__(self, intro: str) -> None:
        self.facts: set[Fact] = {
            ("receptacletype", (r, r.rsplit(" ", 1)[0] + "type"))
            for r in _ITEM.findall(intro.split("Your task", 1)[0])
        }

    def observe(self, feedback: str, front: str | None) -> None:
        f = self.facts
        seen = _SEEN.search(feedback)
        if front and seen:  # arriving shows the whole content of the receptacle
            f -= {x for x in f if x[0] == "inreceptacle" and x[1][1] == front}
            f |= {("inreceptacle", (o, front)) for o in _ITEM.findall(seen.group(1))}
        for pattern, kind in _PATTERNS:
            for m in pattern.finditer(feedback):
                self._apply(kind, m.groups())

    def _apply(self, kind: str, args: tuple[str, ...]) -> None:
        f = self.facts
        if kind == "take":
            f.discard(("inreceptacle", (args[0], args[1])))
            f.add(("holds", ("agent1", args[0])))
        elif kind == "put":
            f.discard(("holds", ("agent1", args[0])))
            f.add(("inreceptacle", (args[0], args[1])))
        elif kind in ("open", "close", "closed"):
            f.add(("openable", (args[0],)))
            (f.add if kind == "open" else f.discard)(("opened", (args[0],)))
        else:
            f.add((kind, (args[0],)))


def _config(data_path: str, screen: int) -> dict[str, Any]:
    """The subset of alfworld's base_config.yaml that AlfredThorEnv reads."""
    return {
        "dataset": {"data_path": data_path, "num_train_games": -1},
        "env": {
            "task_types": [1, 2, 3, 4, 5, 6],
            "goal_desc_human_anns_prob": 0.0,
            "thor": {
                "screen_height": screen,
                "screen_width": screen,
                "smooth_nav": False,
                "save_frames_to_disk": False,
                "save_frames_path": "/tmp/alfworld-frames",
            },
        },
        "controller": {"type": "oracle", "debug": False, "load_receps": True},
        "mask_rcnn": {"pretrained_model_path": ""},
        "general": {"training_method": "dagger"},
        "dagger": {"training": {"max_nb_steps_per_episode": 1000}},
    }


class ThorEngine:
    """alfworld's AlfredThorEnv (oracle controller, batch 1) behind the engine interface."""

    def __init__(self, games: list[str], screen: int = 300) -> None:
        from alfworld.agents.environment.alfred_thor_env import AlfredThorEnv

        root = os.path.commonpath([str(Path(g).parent) for g in games])
        self._env = AlfredThorEnv(_config(root, screen), "train").init_env(1)
        self.task: GameTask | None = None
        self.game_file: str | None = None
        self.frame: np.ndarray | None = None
        self._facts = FeedbackFacts("")
        self._front: str | None = None
        self._rate = 0.0

    def load(self, game_file: str) -> None:
        traj = json.loads((Path(game_file).parent / "traj_data.json").read_text())
        if "object_poses" not in traj.get("scene", {}):
            raise ThorUnavailable(
                f"{game_file}: THOR needs the full data set's traj_data.json "
                "(scene.object_poses); trimmed or synthetic games are text-only"
            )
        self.task, self.game_file = load_task(game_file), game_file

    def reset(self) -> Snapshot:
        assert self.game_file is not None
        self._env.json_file_list = [str(Path(self.game_file).parent / "traj_data.json")]
        obs, infos = self._env.reset()
        self._facts, self._front = FeedbackFacts(obs[0]), None
        return self._snapshot(obs[0], infos)

    def step(self, command: str) -> Snapshot:
        obs, _, _, infos = self._env.step([command])
        arrived = re.search(r"You arrive at (\w+ \d+)", obs[0])
        self._front = arrived.group(1) if arrived else self._front
        self._facts.observe(obs[0], self._front)
        return self._snapshot(obs[0], infos)

    def progress(self, snap: Snapshot) -> tuple[float, float]:
        return self._rate, 1.0

    def _snapshot(self, feedback: str, infos: dict[str, Any]) -> Snapshot:
        self._rate = float(infos["goal_condition_success_rate"][0])
        self.frame = np.ascontiguousarray(self._env.get_frames()[0][:, :, ::-1])  # BGR -> RGB
        return Snapshot(
            feedback=feedback.strip(),
            admissible=list(infos["admissible_commands"][0]),
            won=bool(infos["won"][0]),
            expert_plan=list(infos["extra.expert_plan"][0]),
            facts=sorted(self._facts.facts),
            front=self._front,
        )

    def close(self) -> None:
        self._env.close()


class ThorAlfWorldEnv(AlfWorldEnv):
    """The GTR ALFWorld env with THOR frames as the observation."""

    def __init__(
        self,
        options: AlfWorldOptions,
        image_size: int,
        max_steps: int,
        invalid_action: str,
        seed: int | None,
        engine: ThorEngine,
    ) -> None:
        super().__init__(options, image_size, max_steps, invalid_action, seed, engine=engine)
        self.thor = engine

    def render(self) -> np.ndarray:
        return self.display(self.image_size)

    def display(self, size: int) -> np.ndarray:
        """THOR's frame resized to ``size`` px."""
        if self.thor.frame is None:
            raise RuntimeError("call reset() before using the ALFWorld env")
        frame = Image.fromarray(self.thor.frame)
        return np.asarray(frame.resize((size, size), Image.Resampling.BILINEAR))


def make_thor_env(
    options: AlfWorldOptions, image_size: int, max_steps: int, invalid_action: str, seed: int | None
) -> ThorAlfWorldEnv:
    """The THOR env, or ThorUnavailable naming everything that is missing."""
    missing = thor_missing()
    if missing:
        raise ThorUnavailable(
            "the ALFWorld THOR backend needs: "
            + "; ".join(missing)
            + ". See docs/alfworld.md (THOR); backend='text' works offline."
        )
    from services.env.alfworld.games import find_games

    engine = ThorEngine(find_games(options.games))
    return ThorAlfWorldEnv(options, image_size, max_steps, invalid_action, seed, engine=engine)
