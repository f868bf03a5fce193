"""Study v4's files (issue 56), declared before their first run: each validates as `gtr study
plan` reads it (every cell's run config, the stall check, the tuning section) and declares what
the issue asks: the four arms (bc learning the whole answer, sft_only the thoughts), the exact
and the ~0.7 corrector levels, enough seeds, GTR against each rival as the confirmatory family,
a primary metric other than the noisy final value, one evaluation protocol per task whatever the
arm trains under, and a tuning stage for every arm on seeds no cell is evaluated on."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.study.cli import load_study
from services.study.schemas import StudyConfig
from tests.e2e.helpers import ROOT

STUDIES = ROOT / "configs" / "studies"
FILES = sorted(STUDIES.glob("v4*.toml"))
ARMS = {"gtr", "sft_only", "bc", "rl4vlm"}
MIN_SEEDS = {"ezpoints": 8, "points24": 4}


def test_v4_is_declared() -> None:
    assert STUDIES / "v4.toml" in FILES


@pytest.fixture(scope="module", params=FILES, ids=lambda p: p.name)
def study(request: pytest.FixtureRequest) -> StudyConfig:
    path: Path = request.param
    return load_study(path)


def test_the_arms_and_what_each_learns(study: StudyConfig) -> None:
    assert set(study.arms) == ARMS
    cells = {cell.arm: study.run_config(cell) for cell in study.cells()}
    assert cells["gtr"].algorithm == "gtr" and cells["rl4vlm"].algorithm == "rl4vlm"
    assert cells["sft_only"].algorithm == cells["bc"].algorithm == "sft_only"
    assert cells["sft_only"].train.sft_target == "thought"
    assert cells["bc"].train.sft_target == "output"
    assert study.shared_arms == ["rl4vlm"]


def test_the_exact_and_the_0_7_corrector_levels(study: StudyConfig) -> None:
    levels = {}
    for name, overlay in study.variants.items():
        errors = overlay["corrector"]["errors"]
        levels[name] = 1.0 - sum(errors.get(k, 0.0) for k in ("misread", "arithmetic", "choice"))
    assert sorted(round(v, 2) for v in levels.values()) == [0.7, 1.0], levels


def test_seeds_and_the_confirmatory_family(study: StudyConfig) -> None:
    for task in study.tasks:
        assert len(study.seeds_of(task)) >= MIN_SEEDS[task], task
    pairs = {tuple(p) for p in study.confirmatory}
    assert pairs == {("gtr", rival) for rival in ARMS - {"gtr"}}
    assert study.primary.metric == "eval/success_rate" and study.primary.reduce != "final"


def test_one_evaluation_protocol_per_task(study: StudyConfig) -> None:
    for task in study.tasks:
        configs = [study.run_config(c) for c in study.cells() if c.task == task]
        protocols = {c.metrics.eval_protocol.model_dump_json() for c in configs}  # type: ignore[union-attr]
        assert len(protocols) == 1, task
        # RL4VLM trains without early truncation and is judged under the task's rule anyway.
        rl4vlm = next(c for c in configs if c.algorithm == "rl4vlm")
        assert rl4vlm.env.early_truncation == "off"
        assert rl4vlm.metrics.eval_protocol.env.early_truncation == "reference"  # type: ignore[union-attr]


def test_every_arm_is_tuned_on_seeds_it_is_not_judged_on(study: StudyConfig) -> None:
    tuning = study.tuning
    assert tuning is not None and set(tuning.arms) == ARMS
    judged = {seed for task in study.tasks for seed in study.seeds_of(task)}
    assert tuning.seeds and not judged & set(tuning.seeds)
