"""Group-relative advantages, the self-teacher's KL terms and TIES merging, on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from services.policy import merging
from services.policy.teacher import pick_checkpoints
from services.trainer import algos


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---- group-relative advantages ---------------------------------------------------------------


def test_episode_returns_ordinals_and_completeness() -> None:
    # env 0: episodes [t0..t1] (r 0+1) and [t2] still running; env 1: [t0], [t1..t2].
    rewards = t([[0, 1], [1, 0], [0, 2]])
    dones = t([[0, 1], [1, 0], [0, 1]])
    ret, ordinal, complete = algos.episode_returns(rewards, dones)
    assert torch.equal(ret, t([[1, 1], [1, 2], [0, 2]]))
    assert ordinal.tolist() == [[0, 0], [0, 1], [1, 1]]
    assert complete.tolist() == [[True, True], [True, True], [False, True]]


def test_group_normalize_mean_std_and_degenerate_groups() -> None:
    # group 7: returns 1, 0, 0, 1 → mean .5, population std .5 → Â = ±.5/(.5 + ε)
    # group 3: 2, 2 (all equal) → 0, degenerate; group 9: a single member → 0, degenerate.
    returns = t([1, 0, 2, 0, 1, 2, 5])
    groups = torch.tensor([7, 7, 3, 7, 7, 3, 9])
    adv, deg = algos.group_normalize(returns, groups, eps=1e-6)
    s = 0.5 / (0.5 + 1e-6)
    assert torch.allclose(adv, t([s, -s, 0, -s, s, 0, 0]))
    assert deg.tolist() == [False, False, True, False, False, True, True]
    # Dr. GRPO: R − mean only.
    adv, _ = algos.group_normalize(returns, groups, use_std=False)
    assert torch.allclose(adv, t([0.5, -0.5, 0, -0.5, 0.5, 0, 0]))


def test_grpo_advantages_on_a_rollout_of_two_groups() -> None:
    # G = 2, E = 4: group 0 = envs 0, 1; group 1 = envs 2, 3. T = 3.
    # env 0: one episode t0..t2, R = 1.   env 1: one episode t0..t2, R = 0.
    # env 2: [t0] R = 1, [t1, t2] R = 1.  env 3: [t0] R = 1, [t1..] running (incomplete).
    rewards = t([[0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    dones = t([[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    adv, stats = algos.grpo_advantages(rewards, dones, group_size=2, eps=0.0)
    # group (0, k=0): R = 1, 0 → ±1 on every step of each episode.
    # group (1, k=0): R = 1, 1 → degenerate, 0.  group (1, k=1): env 2 alone → degenerate, 0.
    assert torch.allclose(adv, t([[1, -1, 0, 0], [1, -1, 0, 0], [1, -1, 0, 0]]))
    assert stats["grpo/groups"] == 3 and stats["grpo/degenerate_groups"] == 2
    assert stats["grpo/episodes"] == 5
    assert math.isclose(stats["grpo/incomplete_step_frac"], 2 / 12, rel_tol=1e-6)


def test_degenerate_groups_give_no_policy_gradient() -> None:
    adv, _ = algos.grpo_advantages(t([[1, 1]]), t([[1, 1]]), group_size=2)
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, _ = algos.ppo_clip_loss(logp, logp.detach(), adv.reshape(-1).float(), 0.2)
    loss.backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros(2))


# ---- GTR-Turbo KL ------------------------------------------------------------------------------


def test_thought_kl_penalty_clamps_and_averages_thought_tokens() -> None:
    agent = t([[-1.0, -2.0, -0.5, -3.0]])
    teacher = t([[-3.0, -1.0, -20.0, -9.0]])
    mask = t([[1, 1, 1, 0]])  # the last token is the action: not guided
    # log-ratios 2, −1 → 0 (clamped), 19.5 → 10 (clamped): mean over 3 thought tokens = 4.
    out = algos.thought_kl_penalty(agent, teacher, mask, clip=10.0)
    assert torch.allclose(out, t([4.0]))
    assert torch.equal(algos.thought_kl_penalty(agent, teacher, torch.zeros(1, 4)), t([0.0]))


# ---- TIES ----------------------------------------------------------------------------------------


def test_trim_keeps_the_largest_magnitudes() -> None:
    assert torch.equal(merging.trim(t([0.1, -3, 2, -0.5]), 0.5), t([0, -3, 2, 0]))
    # ⌈0.2·3⌉ = 1: a small tensor keeps at least one entry.
    assert torch.equal(merging.trim(t([1, -4, 2]), 0.2), t([0, -4, 0]))


def test_ties_elects_signs_and_averages_only_agreeing_deltas() -> None:
    d1, d2, d3 = t([2, 1, -1, 0.1]), t([-1, 3, -2, 0.2]), t([4, -5, 1, 0.3])
    # density 1 (no trim). Per entry:
    # 0: 2, −1, 4 → total 5 > 0 → mean(2, 4) = 3
    # 1: 1, 3, −5 → total −1 < 0 → −5;  by frequency (2 positive) → mean(1, 3) = 2
    # 2: −1, −2, 1 → total −2 → mean(−1, −2) = −1.5
    # 3: all positive → .2
    assert torch.allclose(merging.ties([d1, d2, d3], 1.0, "total"), t([3, -5, -1.5, 0.2]))
    assert torch.allclose(merging.ties([d1, d2, d3], 1.0, "frequency"), t([3, 2, -1.5, 0.2]))
    # density .5 trims each to its 2 largest: d1 → (2, 1, 0, 0) — ties among |1| keep the first
    # by topk; use distinct magnitudes instead:
    e1, e2 = t([4, -1, 3, 0.5]), t([-2, 6, 0.1, 1])
    # trimmed: e1 → (4, 0, 3, 0), e2 → (−2, 6, 0, 0); signs by total: (+, +, +, +=0 → +)
    # merged: (4, 6, 3, 0) — entry 3 had no surviving delta, so it stays 0.
    assert torch.allclose(merging.ties([e1, e2], 0.5), t([4, 6, 3, 0]))


def test_ties_agrees_with_peft_where_both_apply() -> None:
    from peft.utils.merge_utils import ties as peft_ties

    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(8, 5, generator=g) for _ in range(3)]
    ours = merging.ties(deltas, 0.4)  # 0.4·40 = 16 entries kept: int and ceil agree
    theirs = peft_ties(deltas, torch.ones(3), 0.4, "total")
    assert torch.allclose(ours, theirs)


def test_ties_merge_on_state_dicts() -> None:
    base = {"w": t([1, 1, 1]), "step": torch.tensor([3])}
    a = {"w": t([3, 1, 0]), "step": torch.tensor([4])}
    b = {"w": t([2, -1, 0.5]), "step": torch.tensor([5])}
    out = merging.ties_merge(base, [a, b], density=1.0)
    # deltas (2, 0, −1), (1, −2, −.5) → signs (+, −, −) → (1.5, −2, −.75) + base
    assert torch.allclose(out["w"], t([2.5, -1, 0.25]))
    assert out["step"].tolist() == [5]  # not a weight: the newest
    assert torch.equal(merging.ties_merge(base, [a], 0.5)["w"], a["w"])
    with pytest.raises(ValueError, match="other keys"):
        merging.ties_merge(base, [{"w": t([1, 1, 1])}], 1.0)


def test_pick_checkpoints_keeps_the_last_k_and_remerges_every_m() -> None:
    assert pick_checkpoints([-1], None, 3, 2) == []  # only the warm start
    assert pick_checkpoints([-1, 0, 1, 2, 3], None, 3, 2) == [1, 2, 3]
    assert pick_checkpoints([-1, 0, 1, 2, 3, 4], [1, 2, 3], 3, 2) == [1, 2, 3]  # 4 − 3 < 2
    assert pick_checkpoints([-1, 0, 1, 2, 3, 4, 5], [1, 2, 3], 3, 2) == [3, 4, 5]
    assert pick_checkpoints([-1, 0], [], 3, 5) == [0]  # the first trained checkpoint
