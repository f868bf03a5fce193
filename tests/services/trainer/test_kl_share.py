"""gtr_turbo_kl's guidance: the KL-to-teacher term's gradient norm and its share of the applied
step (``kl/grad_norm``, ``kl/grad_share``), kept apart as the thought-SFT term's is, on the
trainer's own update of the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.policy.service import Policy
from services.trainer.service import (
    KL_NORM,
    KL_SHARE,
    SFT_SHARE,
    Trainer,
    guidance_term,
    step_gradients,
)
from shared.schemas import TeacherConfig, TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TEXT = '{"current": 2, "target": 7, "thoughts": "I am at 2, so I move +", "action": "+"}'
CFG = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=1, max_grad_norm=1.0)


def _perturbed(tiny_dir: Path) -> Policy:
    teacher = Policy.load(tiny_dir, finetune="full")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return teacher


def _update(tiny_dir: Path, teacher: Policy | None, turbo: TeacherConfig) -> dict[str, float]:
    """One update (one minibatch, one optimiser step) of a fresh agent on one rollout."""
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    ro = rollout_of(policy, shas, ["go"] * 2, [TEXT, TEXT], [1.0, 0.0], num_envs=2)
    trainer = Trainer(policy, CFG, "gtr_turbo_kl")
    trainer.teacher, trainer.turbo = teacher or policy, turbo
    return trainer.update(ro)


def test_the_kl_terms_share_of_one_clip() -> None:
    """The same rule as the SFT term's: its norm over the sum of both parts' norms."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([6.0, 8.0])  # PPO + value: norm 10
    norms = step_gradients([p], [torch.tensor([0.3, 0.4])], 1.0, per_loss=False, term="kl")
    assert norms[KL_NORM] == pytest.approx(0.5) and norms[KL_SHARE] == pytest.approx(0.5 / 10.5)
    assert SFT_SHARE not in norms and norms["grad_norm"] == pytest.approx(10.5)
    assert float(torch.linalg.vector_norm(p.grad)) == pytest.approx(1.0, rel=1e-4)


def test_which_arms_have_a_guidance_term() -> None:
    assert guidance_term("gtr", TeacherConfig()) == "sft"
    assert guidance_term("sft_only", TeacherConfig()) == "sft"
    assert guidance_term("gtr_turbo_kl", TeacherConfig()) == "kl"
    # In the return, the KL moves only the advantages: no gradient of its own to measure.
    assert guidance_term("gtr_turbo_kl", TeacherConfig(kl_into="return")) is None
    assert guidance_term("gtr_turbo_kl", TeacherConfig(kl_coef=0.0)) is None
    assert guidance_term("rl4vlm", TeacherConfig()) is None


def test_a_turbo_update_records_the_kl_terms_norm_and_share(tiny_dir: Path) -> None:
    teacher = _perturbed(tiny_dir)
    one = _update(tiny_dir, teacher, TeacherConfig())
    ten = _update(tiny_dir, teacher, TeacherConfig(kl_coef=10.0))
    assert one["losses/kl"] > 1e-3 and one[KL_NORM] > 0 and 0 < one[KL_SHARE] < 1
    assert not any(k.startswith("sft/") for k in one)
    # The same weights, the same rollout: the KL gradient is linear in kl_coef, the rest of the
    # step (PPO + value) the same, so the share follows from the norms alone.
    assert ten[KL_NORM] == pytest.approx(10 * one[KL_NORM], rel=1e-4)
    rest = one[KL_NORM] * (1 - one[KL_SHARE]) / one[KL_SHARE]
    assert ten[KL_SHARE] == pytest.approx(ten[KL_NORM] / (ten[KL_NORM] + rest), rel=1e-4)
    assert ten[KL_SHARE] > one[KL_SHARE]
    # grad_norm is the whole step's before the clip: within the two parts' sum.
    assert max(one[KL_NORM], rest) - 1e-6 <= one["grad_norm"] <= one[KL_NORM] + rest + 1e-6


def test_a_teacher_at_the_agent_gives_the_kl_term_no_share(tiny_dir: Path) -> None:
    same = _update(tiny_dir, None, TeacherConfig())  # the agent its own teacher: KL 0
    assert same[KL_NORM] == pytest.approx(0.0, abs=1e-6) and same[KL_SHARE] < 1e-6
    apart = _update(tiny_dir, _perturbed(tiny_dir), TeacherConfig(kl_into="return"))
    assert KL_SHARE not in apart and "losses/kl" not in apart
