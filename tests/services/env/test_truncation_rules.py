"""`env.early_truncation`: the reference's rule (GTR's loop) against our solver rule, and which
arms of the study run with which (RL4VLM with none, as its paper)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from services.env import make_env
from shared.schemas import TASKS, EnvConfig, RunConfig

ROOT = Path(__file__).resolve().parents[3]


def _play(env: Any, tokens: list[str]) -> list[tuple[float, bool, bool]]:
    names = env.unwrapped.action_names
    out = []
    for tok in tokens:
        _, reward, terminated, truncated, _ = env.step(names.index(tok))
        out.append((reward, terminated, truncated))
    return out


def _env(task: str, rule: str) -> Any:
    return make_env(task, EnvConfig(early_truncation=rule), seed=0)  # type: ignore[arg-type]


def test_reference_rule_ends_the_episode_on_an_env_reward_of_minus_one() -> None:
    for rule, ended in (("off", False), ("solver", False), ("reference", True)):
        env = _env("points24", rule)
        env.reset(options={"cards": ["HJ", "C2", "C3", "D4"]})
        assert _play(env, ["2"]) == [(0.0, False, False)]
        assert _play(env, ["2"]) == [(-1.0, False, ended)], rule  # the 2 is dealt once
    env = _env("numberline", "reference")
    env.reset(options={"current": 2, "target": 4})
    assert _play(env, ["+", "-"]) == [(0.0, False, False), (-1.0, False, True)]


def test_reference_rule_uses_no_solver_but_the_correctors_target_formula() -> None:
    # An unsolvable deal: the solver rule ends it at the first token, the reference does not
    # (it knows nothing the agent does not, until the corrector names a target).
    for rule, ended in (("solver", True), ("reference", False)):
        env = _env("points24", rule)
        env.reset(options={"cards": ["HA", "SA", "DA", "CA"]})
        assert _play(env, ["1"]) == [(-1.0 if ended else 0.0, False, ended)], rule
    env = _env("points24", "reference")
    env.reset(options={"cards": ["HK", "S4", "D2", "CA"]})
    env.unwrapped.set_target_formula("(10+2)*(4-1)")
    assert _play(env, ["(", "10", "+"]) == [(0.0, False, False)] * 3
    assert _play(env, ["4"]) == [(-1.0, False, True)]  # '(10+4' left the target
    env.reset(options={"cards": ["HK", "S4", "D2", "CA"]})  # a new episode: no target yet
    assert _play(env, ["4", "*"]) == [(0.0, False, False)] * 2


def test_old_configs_keep_their_solver_rule() -> None:
    assert EnvConfig.model_validate({"early_truncation": True}).early_truncation == "solver"
    assert EnvConfig.model_validate({"early_truncation": False}).early_truncation == "off"
    assert EnvConfig().early_truncation == "off"


def test_study_arms_truncate_as_their_papers_ran() -> None:
    """RL4VLM's loop has no early truncation; GTR's (GTR, SFT-only) ends on an env reward of -1."""
    arms = tomllib.loads((ROOT / "configs/repro/arms.toml").read_text())
    bases = [p for p in (ROOT / "configs/repro").rglob("*.toml") if p.stem in TASKS]
    assert bases
    for path in bases:
        base = tomllib.loads(path.read_text())
        for arm, changes in arms.items():
            cfg = tomllib.loads(path.read_text())
            for key, value in changes.items():
                if key != "description":
                    section, _, field = key.rpartition(".")
                    (cfg.setdefault(section, {}) if section else cfg)[field] = value
            rule = EnvConfig.model_validate(cfg.get("env", {})).early_truncation
            if arm == "rl4vlm":
                assert rule == "off", path
            elif path.stem in ("ezpoints", "points24"):  # EZPoints too (issue 55)
                assert rule == "reference", (path, arm)
            assert rule != "solver"  # privileged: no paper arm ran with it
        assert base.get("env", {}).get("early_truncation", "off") in ("off", "reference")
    p24 = RunConfig.from_toml(ROOT / "configs/points24-llava7b-gpu.toml")
    assert p24.env.early_truncation == "reference" and p24.corrector.feedback
