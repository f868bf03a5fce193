"""Does a task's config reward doing nothing? A policy that never answers against one that
answers wrong, played on the real env under the config's env settings.

PPO learns whatever scores best: where an episode the agent never ends (a formula never
submitted, a hand never stood on, an output never readable) ends at the time limit above a wrong
answer's -1, it learns to stall (study v3's Points24 under a 20-step limit). ``check`` plays the
best stalling a few scripts find on a few deals, and ``refuse_stalling`` turns a config where it
scores above a wrong answer into a ValueError naming the task and the figures. The score is the
env's episode return, the figure the greedy evaluation judges; the per-step format bonus
(``train.format_reward``) pays for an output's form whether or not it answers and is left out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from services.env.base import GymCardsEnv
from services.env.registry import CARD_ENVS
from shared.schemas import EnvConfig

WRONG_ANSWER = -1.0  # a wrong '=' (points games), a lost hand (Blackjack), a move away (NumberLine)
SUBMIT = {"ezpoints": "=", "points24": "=", "blackjack": "stand"}  # the action that answers
DEALS = 2  # deals per script (env seeds 0..3): the rules, not the deal, decide a stall's return


@dataclass(frozen=True)
class StallCheck:
    task: str
    stall_return: float | None  # the best return of a never-answering script; None = no script
    wrong_return: float
    how: str  # which script stalled best

    @property
    def rewards_stalling(self) -> bool:
        return self.stall_return is not None and self.stall_return > self.wrong_return


def _play(env: GymCardsEnv, seed: int, choose: str) -> float:
    """One episode under a never-answering script: 'unreadable' (every output unreadable,
    the penalised no-op) or 'greedy' (each step the non-answering action with the best reward,
    one that keeps the episode going on a tie)."""
    env.reset(seed=seed)
    total = 0.0
    for _ in range(env.max_steps + 1):
        if choose == "unreadable":
            _, reward, terminated, truncated, _ = env.noop()
        else:
            action = _best_stall(env)
            _, reward, terminated, truncated, _ = env.step(action)
        total += reward
        if terminated or truncated:
            break
    return total


def _best_stall(env: GymCardsEnv) -> int:
    submit = SUBMIT[env.task]
    best: tuple[float, int, int] | None = None
    for action, name in enumerate(env.action_names):
        if name == submit:
            continue
        probe = copy.deepcopy(env)
        _, reward, terminated, truncated, _ = probe.step(action)
        key = (reward, 0 if (terminated or truncated) else 1, -action)
        if best is None or key > best:
            best = key
    assert best is not None
    return -best[2]


def _blank(self: GymCardsEnv) -> np.ndarray:
    return np.zeros((1, 1, 3), np.uint8)  # the rules, not the picture, decide a return


def check(task: str, env_config: EnvConfig) -> StallCheck:
    """``_check``, once per task and env setting in a process."""
    return _check(task, env_config.model_dump_json())


@lru_cache(maxsize=256)
def _check(task: str, env_json: str) -> StallCheck:
    return _played(task, EnvConfig.model_validate_json(env_json))


def _played(task: str, env_config: EnvConfig) -> StallCheck:
    """The best never-answering return on DEALS deals against a wrong answer's; tasks with no
    card env (ALFWorld) are not played (``stall_return`` None)."""
    if task not in CARD_ENVS:
        return StallCheck(task, None, WRONG_ANSWER, "not checked")
    cfg = env_config.model_copy(update={"image_size": 32, "display_size": 0})
    rules_only = type(f"Undrawn{CARD_ENVS[task].__name__}", (CARD_ENVS[task],), {"_draw": _blank})
    scripts = (["greedy"] if task in SUBMIT else []) + (
        ["unreadable"] if cfg.invalid_action == "noop" else []
    )
    best: tuple[float, str] | None = None
    for script in scripts:
        env = rules_only(cfg)
        value = max(_play(env, seed, script) for seed in range(DEALS))
        if best is None or value > best[0]:
            best = (value, script)
    if best is None:
        return StallCheck(task, None, WRONG_ANSWER, "no way to stall")
    return StallCheck(task, best[0], WRONG_ANSWER, best[1])


def refuse_stalling(task: str, env_config: EnvConfig, where: str = "") -> StallCheck:
    """``check``, raising a one-line ValueError where never answering beats a wrong answer."""
    result = check(task, env_config)
    if result.rewards_stalling:
        at = f"{where}: " if where else ""
        limit = env_config.max_episode_steps
        raise ValueError(
            f"{at}task {task!r} rewards stalling: a policy that never answers scores "
            f"{result.stall_return:g} ({result.how}), above a wrong answer's "
            f"{result.wrong_return:g}, under env.max_episode_steps = {limit}; PPO would learn "
            f"to stall (docs/studies.md, 'No config rewards stalling')"
        )
    return result
