"""The self-teacher built from real checkpoints (LoRA through peft, full FT through our TIES),
and the grpo / gtr_turbo_kl update on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.service import Policy
from services.policy.teacher import build_teacher
from services.trainer.service import Trainer
from shared.schemas import TeacherConfig, TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TEXT = '{"current": 2, "target": 7, "thoughts": "I am at 2, so I move +", "action": "+"}'


def _perturb(policy: Policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _logprobs(policy: Policy, image: object) -> torch.Tensor:
    ids = [policy.encode_response(TEXT)]
    return policy.score([image], ["go"], ids).logprobs


@pytest.mark.parametrize(
    ("finetune", "lora_merge"), [("lora", "ties"), ("lora", "ties_svd"), ("full", "ties")]
)
def test_teacher_of_identical_checkpoints_is_that_checkpoint(
    tiny_dir: Path, tmp_path: Path, finetune: str, lora_merge: str
) -> None:
    """TIES of k equal deltas is that delta: the teacher scores exactly as the checkpoint does,
    and the warm start (no trained checkpoint) scores as the base."""
    policy = Policy.load(tiny_dir, finetune=finetune, lora_r=4, seed=0)  # type: ignore[arg-type]
    policy.save(tmp_path / "base")
    image = np.full((64, 64, 3), 90, dtype=np.uint8)
    base_lp = _logprobs(policy, image)
    _perturb(policy, 1)
    for name in ("a", "b"):
        policy.save(tmp_path / name)
    trained_lp = _logprobs(policy, image)
    cfg = TeacherConfig(density=1.0, lora_merge=lora_merge)  # type: ignore[arg-type]
    teacher = build_teacher(tmp_path / "base", [tmp_path / "a", tmp_path / "b"], cfg)
    assert not torch.allclose(base_lp, trained_lp)
    assert torch.allclose(_logprobs(teacher, image), trained_lp, atol=1e-4)
    assert not any(p.requires_grad for p in teacher.model.parameters())
    # Re-merged in place onto the warm start (no checkpoint): back to the base's scores.
    again = build_teacher(tmp_path / "base", [], cfg, current=teacher)
    assert again is teacher and torch.allclose(_logprobs(again, image), base_lp, atol=1e-5)


def test_grpo_and_turbo_kl_updates(tiny_dir: Path) -> None:
    """grpo: group-relative advantages, no value loss (the value head does not move), its
    degenerate groups counted; gtr_turbo_kl: the KL to a teacher is measured and trained."""
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))] * 2
    # E = 4 envs, T = 1: every step ends its episode; groups (0, 1) and (2, 3).
    # Group 0 returns 1 vs 0 (signal); group 1 returns 1 vs 1 (degenerate).
    ro = rollout_of(policy, shas, ["go"] * 4, [TEXT] * 4, [1.0, 0.0, 1.0, 1.0], num_envs=4)
    ro.dones[:] = True
    cfg = TrainConfig(num_envs=4, num_steps=1, minibatch_size=4, ppo_epochs=1, group_size=2)
    trainer = Trainer(policy, cfg, "grpo")
    head = [p.detach().clone() for p in policy.value_head.parameters()]
    m = trainer.update(ro)
    assert m["grpo/groups"] == 2 and m["grpo/degenerate_groups"] == 1
    assert "losses/value" in m and m["grad_norm"] > 0
    assert all(torch.equal(a, b) for a, b in zip(head, policy.value_head.parameters(), strict=True))

    kl = Trainer(policy, cfg.model_copy(update={"minibatch_size": 2}), "gtr_turbo_kl")
    with pytest.raises(RuntimeError, match="teacher"):
        kl.update(ro)
    # The rollout was scored by the untrained model: a perturbed copy as the teacher has KL > 0.
    kl.teacher = Policy.load(tiny_dir, finetune="full")
    _perturb(kl.teacher, 3)
    m = kl.update(ro)
    assert m["turbo/kl_mean"] > 0 and m["turbo/kl_max"] <= kl.turbo.kl_clip
