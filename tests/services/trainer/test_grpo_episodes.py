"""GRPO by whole episodes (train.grpo_rollout = "episodes"): only each env's first episode forms
groups, so every group has all G members; the zero-advantage share of steps is recorded."""

from __future__ import annotations

import math

import torch

from services.trainer import algos


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
