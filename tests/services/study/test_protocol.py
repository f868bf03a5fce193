"""A study's evaluation protocol comes from the task (and variant), never from an arm: every arm
of a group is evaluated under the same rules whatever it trains under; and the reducers."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.controller.evaluate import protocol_record
from services.study.schemas import Cell, MetricSpec, StudyConfig

ROOT = Path(__file__).resolve().parents[3]


def test_every_arm_of_a_v3_group_is_evaluated_under_one_protocol() -> None:
    study = StudyConfig.from_toml(ROOT / "configs/studies/v3.toml")
    for task in study.tasks:
        seed = study.seeds_of(task)[0]
        rl4vlm = study.run_config(Cell(task, "rl4vlm", seed))
        gtr = study.run_config(Cell(task, "gtr", seed, "acc-1.0"))
        assert rl4vlm.env.early_truncation == "off"  # it trains without GTR's rule ...
        assert gtr.env.early_truncation == "reference"
        # ... and is scored under the task's, as GTR is.
        assert protocol_record(rl4vlm)["key"] == protocol_record(gtr)["key"]
        assert protocol_record(rl4vlm)["env"]["early_truncation"] == "reference"


def test_a_task_declares_its_protocol_over_its_base() -> None:
    raw = {
        "name": "p",
        "seeds": [0],
        "tasks": {
            "numberline": {
                "base": {"task": "numberline", "env": {"image_size": 64}},
                "evaluation": {"env": {"max_episode_steps": 6}, "max_new_tokens": 24},
            }
        },
        "arms": {
            "a": {"algorithm": "gtr"},
            "b": {"algorithm": "rl4vlm", "env": {"invalid_action": "noop"}},
        },
    }
    study = StudyConfig.model_validate(raw)
    p = study.run_config(Cell("numberline", "b", 0)).metrics.eval_protocol
    assert p is not None and p.max_new_tokens == 24
    assert (p.env.image_size, p.env.max_episode_steps) == (64, 6)
    assert p.env.invalid_action == "random"  # the arm's own env change is not the protocol's
    raw["tasks"]["numberline"]["evaluation"] = {"seeds": [1]}
    with pytest.raises(ValueError, match="evaluation: unknown key 'seeds'"):
        StudyConfig.model_validate(raw)


def test_confirmatory_names_pairs_of_arms() -> None:
    raw = {
        "name": "c",
        "seeds": [0],
        "tasks": {"numberline": {"base": {"task": "numberline"}}},
        "arms": {"a": {"algorithm": "gtr"}, "b": {"algorithm": "rl4vlm"}},
        "confirmatory": [["a", "b"]],
    }
    assert StudyConfig.model_validate(raw).confirmatory == [["a", "b"]]
    with pytest.raises(ValueError, match="'c' is not an arm"):
        StudyConfig.model_validate(raw | {"confirmatory": [["a", "c"]]})
    with pytest.raises(ValueError, match="not a pair of two different arms"):
        StudyConfig.model_validate(raw | {"confirmatory": [["a", "a"]]})


def test_the_reducers() -> None:
    curve = [(0, 0.2), (5, 0.6), (10, 0.1), (15, 0.5)]
    assert MetricSpec(metric="m").score(curve) == 0.5
    assert MetricSpec(metric="m", reduce="last_k_mean", k=2).score(curve) == pytest.approx(0.3)
    assert MetricSpec(metric="m", reduce="mean").score(curve) == pytest.approx(0.35)
    assert MetricSpec(metric="m", reduce="mean").label() == "m (mean over all points)"
    assert MetricSpec(metric="m", reduce="last_k_mean", k=5).score(curve) is None
