"""Task registry: ``make_env`` and the gymnasium ids ``gtr/NumberLine-v0`` ..."""

from __future__ import annotations

import gymnasium as gym

from services.env.base import GymCardsEnv
from services.env.blackjack import BlackjackEnv
from services.env.numberline import NumberLineEnv
from services.env.points import EZPointsEnv, Points24Env
from shared.schemas import EnvConfig

CARD_ENVS: dict[str, type[GymCardsEnv]] = {
    "numberline": NumberLineEnv,
    "ezpoints": EZPointsEnv,
    "points24": Points24Env,
    "blackjack": BlackjackEnv,
}
CARD_TASKS: tuple[str, ...] = tuple(CARD_ENVS)
TASKS: tuple[str, ...] = (*CARD_TASKS, "alfworld")
GYM_IDS: dict[str, str] = {
    "numberline": "gtr/NumberLine-v0",
    "ezpoints": "gtr/EZPoints-v0",
    "points24": "gtr/Points24-v0",
    "blackjack": "gtr/Blackjack-v0",
}


def make_env(task: str, config: EnvConfig | None = None, seed: int | None = None) -> gym.Env:
    """A fresh environment of ``task``; its first ``reset()`` uses ``seed``."""
    if task == "alfworld":
        from services.env.alfworld import make_alfworld_env  # optional extra, owned elsewhere

        return make_alfworld_env(config, seed)
    if task not in CARD_ENVS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return CARD_ENVS[task](config, seed)


for _task, _gym_id in GYM_IDS.items():
    if _gym_id not in gym.registry:
        _cls = CARD_ENVS[_task]
        gym.register(
            _gym_id, entry_point=f"{_cls.__module__}:{_cls.__name__}", disable_env_checker=True
        )
