"""No shipped preset rewards stalling: under every env setting a preset in configs/,
configs/repro/ (each arm and variant applied) and configs/studies/ (every cell) gives, a
policy that never answers scores no more than one that answers wrong (services/env/stalling.py).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from services.env.points import Points24Env
from services.env.registry import make_env
from services.env.stalling import WRONG_ANSWER, check, refuse_stalling
from services.study.schemas import StudyConfig, merge
from shared.schemas import EnvConfig, RunConfig

ROOT = Path(__file__).resolve().parents[3]
TASKS = ("numberline", "ezpoints", "points24", "blackjack", "alfworld")


def _dotted(changes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if key in ("description", "unchanged"):
            continue
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _preset_envs() -> list[tuple[str, str, EnvConfig]]:
    """(where, task, env) for every env setting a shipped preset gives a run."""
    out: list[tuple[str, str, EnvConfig]] = []
    runs = [*ROOT.glob("configs/*.toml"), *ROOT.glob("configs/repro/**/*.toml")]
    overlays = {
        name: tomllib.loads((ROOT / "configs/repro" / name).read_text())
        for name in ("arms.toml", "variants.toml")
    }
    for path in sorted(runs):
        if path.name in overlays:
            continue
        raw = tomllib.loads(path.read_text())
        if raw.get("task") not in TASKS:
            continue
        where = str(path.relative_to(ROOT))
        out.append((where, raw["task"], RunConfig.model_validate(raw).env))
        if path.parent.name in ("repro", "gpu"):
            for file, table in overlays.items():
                for name, changes in table.items():
                    env = merge(raw, _dotted(changes)).get("env", {})
                    out.append((f"{where} + {file}[{name}]", raw["task"], EnvConfig(**env)))
    for path in sorted(ROOT.glob("configs/studies/*.toml")):
        study = StudyConfig.from_toml(path)  # validation refuses a stalling cell already
        for cell in study.cells():
            cfg = study.run_config(cell)
            out.append((f"{path.name}: {cell.describe()}", cfg.task, cfg.env))
    return out


PRESETS = _preset_envs()


def test_presets_found() -> None:
    wheres = " ".join(w for w, _, _ in PRESETS)
    for name in ("points24-tiny.toml", "repro/points24.toml", "arms.toml[rl4vlm]", "v3.toml"):
        assert name in wheres
    assert {t for _, t, _ in PRESETS} >= {"numberline", "ezpoints", "points24", "blackjack"}


def test_no_shipped_preset_rewards_stalling() -> None:
    seen: dict[tuple[str, str], float | None] = {}
    for where, task, env in PRESETS:
        key = (task, env.model_dump_json())
        if key not in seen:
            seen[key] = check(task, env).stall_return
        stall = seen[key]
        assert stall is None or stall <= WRONG_ANSWER, (where, stall)
    # The card presets are all played: a stall there is a number, not a skip.
    assert any(v is not None for (t, _), v in seen.items() if t == "points24")


def test_v3_points24_stall_now_ends_at_minus_one() -> None:
    """v3's Points24 setting (20 steps, the formula limit): typing '(' twenty times used to end
    at 0 by the time limit; the stall penalty makes it the over-length -1."""
    env = make_env("points24", EnvConfig(max_episode_steps=20, invalid_action="noop"), seed=3)
    env.reset()
    total, done, steps = 0.0, False, 0
    while not done:
        _, reward, terminated, truncated, _ = env.step(env.action_names.index("("))  # type: ignore[attr-defined]
        total, done, steps = total + reward, terminated or truncated, steps + 1
    assert (steps, total) == (20, -1.0)
    # Under the reference's own TimeLimit (300) the formula limit ends it at -1 too (step 22).
    env = make_env("points24", EnvConfig(invalid_action="noop"), seed=3)
    env.reset()
    rewards = []
    for _ in range(30):
        _, reward, terminated, truncated, _ = env.step(env.action_names.index("("))  # type: ignore[attr-defined]
        rewards.append(reward)
        if terminated or truncated:
            break
    assert (len(rewards), sum(rewards)) == (22, -1.0)


def test_a_wrong_answer_scores_minus_one() -> None:
    env = make_env("ezpoints", EnvConfig(), seed=0)
    env.reset()
    _, reward, terminated, _, _ = env.step(env.action_names.index("="))  # type: ignore[attr-defined]
    assert (reward, terminated) == (WRONG_ANSWER, True)


class _NoPenaltyPoints24(Points24Env):
    """Points24 as it was before the stall penalty (study v3's env)."""

    stall_penalty = None


def test_the_check_refuses_an_env_that_rewards_stalling(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.env import stalling

    env = EnvConfig(max_episode_steps=20)
    assert not check("points24", env).rewards_stalling
    monkeypatch.setitem(stalling.CARD_ENVS, "points24", _NoPenaltyPoints24)
    env = EnvConfig(max_episode_steps=18)  # a setting not checked (and cached) above
    result = check("points24", env)
    assert result.rewards_stalling and result.stall_return == 0.0
    with pytest.raises(ValueError, match="rewards stalling: a policy that never answers"):
        refuse_stalling("points24", env, "task 'points24'")
