"""Every arm of a study under one format rule and one invalid-output rule (issue 55): the arms of
configs/repro/arms.toml applied to each task's base config, as bench/reproduce.py and the study
files build them."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from shared.schemas import TASKS, EnvConfig, TeacherConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[3]
ARMS = tomllib.loads((ROOT / "configs/repro/arms.toml").read_text())
BASES = [p for p in (ROOT / "configs/repro").rglob("*.toml") if p.stem in TASKS]


class Arm(NamedTuple):
    algorithm: str
    train: TrainConfig
    env: EnvConfig
    teacher: TeacherConfig


def _arm(path: Path, changes: dict[str, Any]) -> Arm:
    """The arm's sections, each validated (a GPU config's single env cannot hold a GRPO group:
    the run would be refused, its format rule is still the arm's)."""
    cfg = tomllib.loads(path.read_text())
    for key, value in changes.items():
        if key != "description":
            section, _, field = key.rpartition(".")
            (cfg.setdefault(section, {}) if section else cfg)[field] = value
    return Arm(
        cfg["algorithm"],
        TrainConfig.model_validate(cfg.get("train", {})),
        EnvConfig.model_validate(cfg.get("env", {})),
        TeacherConfig.model_validate(cfg.get("teacher", {})),
    )


def _format_rule(run: Arm) -> tuple[float, float]:
    """(bonus of a well-formed step, cost of a malformed one) as the arm's trainer pays them."""
    malformed = 0.0
    if run.algorithm == "gtr_turbo_kl":
        malformed = -run.teacher.malformed_reward
        if run.teacher.kl_into == "return":
            malformed += run.teacher.kl_coef * run.teacher.malformed_kl
    return run.train.format_reward, malformed


def test_every_arm_pays_the_same_for_a_malformed_output() -> None:
    assert len(BASES) >= 4
    for path in BASES:
        gtr = _format_rule(_arm(path, ARMS["gtr"]))
        for name, changes in ARMS.items():
            bonus, malformed = _format_rule(_arm(path, changes))
            assert malformed == gtr[1], (path, name)  # the Turbo-KL arm paid about 102
            if name != "rl4vlm":  # RL4VLM's paper had no format bonus (test_fidelity.py)
                assert bonus == gtr[0], (path, name)


def test_an_unparsable_output_plays_a_random_action_in_every_arm() -> None:
    """GTR's reference replaces an unparsable output by a random legal action; "noop" ended a
    truncated episode on one malformed output."""
    for path in BASES:
        for name, changes in ARMS.items():
            assert _arm(path, changes).env.invalid_action == "random", (path, name)


def test_bc_supervises_the_whole_answer_and_sft_only_the_thought() -> None:
    for path in BASES:
        bc, sft = _arm(path, ARMS["bc"]), _arm(path, ARMS["sft_only"])
        assert bc.algorithm == sft.algorithm == "sft_only"
        assert bc.train.sft_target == "output" and sft.train.sft_target == "thought"
