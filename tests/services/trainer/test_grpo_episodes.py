"""GRPO by whole episodes (train.grpo_rollout = "episodes"): only each env's first episode forms
groups, so every group has all G members; the zero-advantage share of steps is recorded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from services.policy.service import Policy
from services.trainer import algos
from services.trainer.buffer import DaggerBuffer, SftExample
from services.trainer.service import Trainer
from shared.schemas import TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TEXT = '{"current": 2, "target": 7, "thoughts": "I am at 2, so I move +", "action": "+"}'


def t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_first_episodes_form_full_groups_and_zero_advantage_steps_are_counted() -> None:
    # G = 2, E = 2, T = 4. env 0: [t0, t1] R = 1, then [t2, t3] R = 1 (a second, short one).
    # env 1: [t0 .. t3] R = 0 (the rollout ran until it ended).
    rewards = t([[0, 0], [1, 0], [0, 0], [1, 0]])
    dones = t([[0, 0], [1, 0], [0, 0], [1, 1]])
    steps, s_stats = algos.grpo_advantages(rewards, dones, group_size=2, eps=0.0)
    whole, w_stats = algos.grpo_advantages(rewards, dones, group_size=2, eps=0.0, first_only=True)
    # By steps, env 0's second episode is a group of one (degenerate) beside (0, k=0).
    assert s_stats["grpo/groups"] == 2 and s_stats["grpo/degenerate_groups"] == 1
    # By episodes: one group (0, k=0) with both members, R = 1 vs 0 → ±1; the second
    # episode's steps train nothing.
    assert torch.allclose(whole, t([[1, -1], [1, -1], [0, -1], [0, -1]]))
    assert w_stats["grpo/groups"] == 1 and w_stats["grpo/degenerate_groups"] == 0
    assert math.isclose(w_stats["grpo/zero_adv_frac"], 2 / 8)
    assert math.isclose(s_stats["grpo/zero_adv_frac"], 2 / 8)
    # A degenerate group counts all its steps as zero-advantage.
    _, d_stats = algos.grpo_advantages(t([[1, 1]]), t([[1, 1]]), group_size=2, first_only=True)
    assert d_stats["grpo/zero_adv_frac"] == 1.0


def test_grpo_trains_its_grouped_steps_and_gtr_grpo_draws_gtrs_sft_budget(tiny_dir: Path) -> None:
    """A step left over after its env's grouped episode (Â = 0) is not trained (it would dilute
    the policy-gradient mean), and gtr_grpo draws num_envs × num_steps SFT examples an epoch,
    as gtr does, however short its rollout of whole episodes."""
    policy = Policy.load(tiny_dir, finetune="full")
    sha = put_image((10, 20, 30))
    # E = 2, T = 3: env 0's episode ends at t0 (t1, t2 are left over); env 1's at t2.
    ro = rollout_of(policy, [sha] * 6, ["go"] * 6, [TEXT] * 6, [1, 0, 0, 0, 0, 0], num_envs=2)
    ro.dones[:] = [True, False, False, False, False, True]  # t-major: index t * E + e
    cfg = TrainConfig(num_envs=2, num_steps=8, group_size=2, minibatch_size=2, ppo_epochs=1)
    trainer = Trainer(policy, cfg, "gtr_grpo")
    adv, ret = trainer.compute_advantages(ro)
    assert trainer.trained is not None and np.flatnonzero(trainer.trained).tolist() == [0, 1, 3, 5]
    seen = {int(i) for b in trainer.minibatches(ro, adv, ret) for i in b.idx}
    assert seen == {0, 1, 3, 5}
    buffer = DaggerBuffer(0)
    buffer.add([SftExample(i, 0, "go", sha, TEXT, None) for i in range(3)])
    metrics = trainer.update(ro, buffer)
    assert metrics["grpo/trained_steps"] == 4
    assert metrics["sft_draws"] == 2 * 8  # gtr's: one per PPO sample of a full rollout
