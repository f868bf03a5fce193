"""Evaluation and probe deals never share a seed with a training env: over 10,000 run seeds,
every update and env slot of each preset, and the bounds of every valid run config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from shared.schemas import GROUP_ALGORITHMS, MetricsConfig, RunConfig, TrainConfig
from shared.seeds import (
    EVAL_SEED_BASE,
    MAX_ENVS,
    MAX_RUN_SEED,
    MAX_UPDATES,
    PROBE_SEED_BASE,
    SPACE_SIZE,
    TRAIN_SEED_LIMIT,
    eval_seed,
    probe_seed,
    train_env_seed,
    warm_start_seed,
)

ROOT = Path(__file__).resolve().parents[3]
RUN_SEEDS = 10_000
PRESETS = sorted((ROOT / "configs").glob("*.toml"))


def _limit(model: type[BaseModel], name: str) -> int:
    """The `le` bound of a config field, read from the schema itself."""
    meta = model.model_fields[name].metadata
    return int(next(m.le for m in meta if getattr(m, "le", None) is not None))


def test_the_bounds_follow_the_run_config_schema() -> None:
    # If a schema limit grows, the proof below must be redone: these fail first.
    assert _limit(RunConfig, "seed") == MAX_RUN_SEED
    assert _limit(TrainConfig, "num_updates") == MAX_UPDATES
    assert _limit(TrainConfig, "num_envs") == MAX_ENVS
    worst = train_env_seed(MAX_RUN_SEED, MAX_UPDATES - 1, MAX_ENVS - 1)
    assert worst < TRAIN_SEED_LIMIT <= EVAL_SEED_BASE
    assert warm_start_seed(MAX_RUN_SEED) < TRAIN_SEED_LIMIT
    # The two deal spaces are disjoint and hold every evaluation and probe a config can ask for.
    assert EVAL_SEED_BASE + SPACE_SIZE <= PROBE_SEED_BASE
    assert PROBE_SEED_BASE + SPACE_SIZE <= 2**63 - 1  # BigInteger columns, the env service
    assert _limit(MetricsConfig, "eval_episodes") < SPACE_SIZE
    assert _limit(MetricsConfig, "probe_states") < SPACE_SIZE
    with pytest.raises(ValueError):
        eval_seed(SPACE_SIZE)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_no_training_env_of_a_preset_reaches_an_evaluation_or_probe_seed(preset: Path) -> None:
    cfg = RunConfig.from_toml(preset)
    per = cfg.train.group_size if cfg.algorithm in GROUP_ALGORITHMS else 1
    slots = np.arange(cfg.train.num_envs) // per
    updates = np.arange(cfg.train.num_updates)
    seeds = np.arange(RUN_SEEDS, dtype=np.int64)
    # Every training env seed of run seeds 0..9,999: train_env_seed over the whole grid.
    grid = (seeds[:, None, None] * 1000 + updates[None, :, None]) * 1000 + slots[None, None, :]
    u = min(2, cfg.train.num_updates - 1)  # a preset may train for fewer than 3 updates
    assert int(grid[3, u, -1]) == train_env_seed(3, u, int(slots[-1]))  # the same formula
    last = train_env_seed(RUN_SEEDS - 1, cfg.train.num_updates - 1, int(slots[-1]))
    assert int(grid[-1, -1, -1]) == last
    evaluation = np.array([eval_seed(i) for i in range(max(cfg.metrics.eval_episodes, 1000))])
    probes = np.array([probe_seed(i) for i in range(max(cfg.metrics.probe_states, 2000))])
    # The three sets lie in disjoint intervals, training (and the warm start's oracle envs, seeded
    # by the run seed) < evaluation < probes, so no two share a seed. Their min and max over the
    # whole grid prove it without sorting its millions of seeds (np.unique and np.intersect1d
    # took 10-30 s a preset).
    assert min(int(grid.min()), int(seeds.min())) >= 0
    assert max(int(grid.max()), int(seeds.max())) < int(evaluation.min())
    assert int(evaluation.max()) < int(probes.min())


def test_the_old_evaluation_seeds_did_collide() -> None:
    """What this replaced: deals at 2,000,003 + i were the training deals of run seed 2."""
    assert train_env_seed(2, 0, 3) == 2_000_003
    assert train_env_seed(2, 0, 3) != eval_seed(0)
