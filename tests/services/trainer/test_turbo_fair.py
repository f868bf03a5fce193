"""GTR-Turbo as its authors run it: a running merge over every checkpoint (the last-k merge a
switch), and malformed outputs charged KL 100 and a format reward of -2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.service import Policy
from services.policy.teacher import CheckpointRef, TeacherCache
from services.trainer import algos
from services.trainer.service import Trainer
from shared.schemas import TeacherConfig, TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TEXT = '{"current": 2, "target": 7, "thoughts": "I am at 2, so I move +", "action": "+"}'


def test_malformed_outputs_cost_kl_and_a_negative_format_reward(tiny_dir: Path) -> None:
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    ro = rollout_of(policy, shas, ["go"] * 2, [TEXT, "oops {"], [1.0, 1.0], num_envs=2)
    ro.format_valid[:] = [True, False]
    cfg = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=1)
    returns = {}
    for name, teacher in (
        ("authors", TeacherConfig(kl_into="return")),
        ("before", TeacherConfig(kl_into="return", malformed_kl=0.0, malformed_reward=0.0)),
        ("thought_loss", TeacherConfig()),  # the default: the KL stays out of the return
    ):
        trainer = Trainer(policy, cfg, "gtr_turbo_kl")
        trainer.teacher, trainer.turbo = policy, teacher  # the agent itself: KL 0 where scored
        returns[name] = trainer.compute_advantages(ro)[1].cpu()
        assert trainer._extra["turbo/malformed_frac"] == pytest.approx(0.5)
        assert trainer._extra["turbo/kl_mean"] == pytest.approx(0.0, abs=1e-5)
    gap = returns["authors"] - returns["before"]
    assert gap.tolist() == pytest.approx([0.0, -(100.0 + 2.0)])  # kl_coef 1: -100 KL, -2 format
    gap = returns["thought_loss"] - returns["before"]
    assert gap.tolist() == pytest.approx([0.0, -2.0])  # only the format reward; no KL 100


def test_thought_kl_loss_moves_thought_tokens_only(tiny_dir: Path) -> None:
    """teacher.kl_into = "thought_loss": the KL to the teacher reaches the thought tokens, not the
    action (under "return" it entered the advantage of every token); the return is the same
    whatever the teacher."""
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    ro = rollout_of(policy, shas, ["go"] * 2, [TEXT, TEXT], [1.0, 0.0], num_envs=2)
    cfg = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=1)
    other = Policy.load(tiny_dir, finetune="full")
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    returns = []
    for teacher in (policy, other):
        trainer = Trainer(policy, cfg, "gtr_turbo_kl")
        trainer.teacher = teacher
        returns.append(trainer.compute_advantages(ro)[1].cpu())
    assert torch.allclose(returns[0], returns[1])  # the teacher is not in the return
    assert trainer._extra["turbo/kl_mean"] > 1e-3  # yet it is measured: another policy
    # The loss's gradient w.r.t. the token log-probs: on thought tokens, none on the action.
    th, ac = (torch.as_tensor(m).float() for m in (ro.thought_mask, ro.action_mask))
    lp = torch.as_tensor(ro.old_logprobs).clone().requires_grad_(True)
    t_lp = torch.as_tensor(trainer._teacher_lp)
    algos.thought_kl_loss(lp, t_lp, th * torch.as_tensor(trainer._teacher_valid)).backward()
    assert lp.grad is not None
    assert lp.grad[th.bool()].abs().sum() > 0 and lp.grad[ac.bool()].abs().sum() == 0
    # One update trains it beside PPO, and reports it.
    assert trainer.update(ro)["losses/kl"] > 0


def test_running_merge_takes_every_checkpoint_last_k_the_newest(
    tiny_dir: Path, tmp_path: Path
) -> None:
    policy = Policy.load(tiny_dir, finetune="full")
    policy.save(tmp_path / "base")
    refs = [CheckpointRef(1, -1, tmp_path / "base")]
    g = torch.Generator().manual_seed(0)
    for u in range(3):
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        policy.save(tmp_path / f"u{u}")
        refs.append(CheckpointRef(u + 2, u, tmp_path / f"u{u}"))
    running = TeacherCache(TeacherConfig(lag=0))  # the authors': the acting policy included
    running.get(refs)
    assert running.updates == [0, 1, 2] and running.ids == [2, 3, 4]
    lagged = TeacherCache(TeacherConfig())  # the default: the acting policy (update 2) left out
    lagged.get(refs)
    assert lagged.updates == [0, 1] and lagged.ids == [2, 3]
    assert TeacherCache(TeacherConfig(lag=3)).get(refs) is not None  # the warm start alone
    last = TeacherCache(TeacherConfig(merge="last_k", keep_last=2, lag=0))
    last.get(refs)
    assert last.updates == [1, 2]
    image = np.full((64, 64, 3), 90, dtype=np.uint8)
    ids = [policy.encode_response(TEXT)]
    scores = [c.get(refs).score([image], ["go"], ids).logprobs for c in (running, last)]
    assert not torch.allclose(scores[0], scores[1])  # two different teachers
