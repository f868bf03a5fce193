"""GTR-Turbo as its authors run it: a running merge over every checkpoint (the last-k merge a
switch), and malformed outputs charged KL 100 and a format reward of -2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.service import Policy
from services.policy.teacher import CheckpointRef, TeacherCache
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
        ("authors", TeacherConfig()),
        ("before", TeacherConfig(malformed_kl=0.0, malformed_reward=0.0)),
    ):
        trainer = Trainer(policy, cfg, "gtr_turbo_kl")
        trainer.teacher, trainer.turbo = policy, teacher  # the agent itself: KL 0 where scored
        returns[name] = trainer.compute_advantages(ro)[1].cpu()
        assert trainer._extra["turbo/malformed_frac"] == pytest.approx(0.5)
        assert trainer._extra["turbo/kl_mean"] == pytest.approx(0.0, abs=1e-5)
    gap = returns["authors"] - returns["before"]
    assert gap.tolist() == pytest.approx([0.0, -(100.0 + 2.0)])  # kl_coef 1: -100 KL, -2 format


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
    running = TeacherCache(TeacherConfig())  # the default: the authors' running merge
    running.get(refs)
    assert running.updates == [0, 1, 2] and running.ids == [2, 3, 4]
    last = TeacherCache(TeacherConfig(merge="last_k", keep_last=2))
    last.get(refs)
    assert last.updates == [1, 2]
    image = np.full((64, 64, 3), 90, dtype=np.uint8)
    ids = [policy.encode_response(TEXT)]
    scores = [c.get(refs).score([image], ["go"], ids).logprobs for c in (running, last)]
    assert not torch.allclose(scores[0], scores[1])  # two different teachers
