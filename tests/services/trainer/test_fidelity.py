"""The switches of docs/fidelity.md on hand-computed tensors: each departure from the GTR
reference and the setting that restores the reference's behaviour."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.trainer import algos
from services.trainer.buffer import DaggerBuffer, SftExample, build_output_target
from shared.schemas import TASKS, RunConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[3]


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_reference_ratio_rule_keeps_only_the_clipped_surrogate() -> None:
    adv = t([1.0, -1.0, -1.0])
    old = torch.zeros(3, dtype=torch.float64)
    logp = t([0.0, math.log(0.5), math.log(12.0)]).requires_grad_()
    loss, ratio = algos.ppo_clip_loss_reference(logp, old, adv, clip=0.2)
    # ρ = 1, .5, 12: 12 > 10 → L = −mean(clip(ρ)·Â) = −(1·1 + .8·(−1) + 1.2·(−1))/3 = 1/3
    assert torch.allclose(ratio, t([1.0, 0.5, 12.0]))
    assert math.isclose(loss.item(), 1.0 / 3.0)
    loss.backward()
    # Only the first sample is inside the clip range: dL/dlogp0 = −ρ·Â/3.
    assert torch.allclose(logp.grad, t([-1 / 3, 0.0, 0.0]))
    # The default (log-ratio cap) takes min(ρÂ, clip(ρ)Â): −(1 − .8 − 12)/3, a huge push.
    capped, _ = algos.ppo_clip_loss(logp.detach(), old, adv, clip=0.2)
    assert math.isclose(capped.item(), (12.0 + 0.8 - 1.0) / 3.0)


def test_reference_ratio_rule_is_the_usual_loss_below_ten() -> None:
    logp, old, adv = t([0.1, -0.3, 0.5]), t([0.0, 0.0, 0.0]), t([1.0, -2.0, 0.5])
    ref, _ = algos.ppo_clip_loss_reference(logp, old, adv, clip=0.2)
    usual, _ = algos.ppo_clip_loss(logp, old, adv, clip=0.2)
    assert math.isclose(ref.item(), usual.item())


def test_cosine_sft_weight_goes_from_coef_to_zero() -> None:
    assert algos.cosine_weight(2.0, 0, 10) == 2.0
    assert math.isclose(algos.cosine_weight(2.0, 5, 10), 1.0)
    assert math.isclose(algos.cosine_weight(2.0, 10, 10), 0.0, abs_tol=1e-12)
    assert math.isclose(algos.cosine_weight(2.0, 12, 10), 0.0, abs_tol=1e-12)  # stays at 0


def test_judge_and_length_reward_terms() -> None:
    assert torch.equal(
        algos.judge_bonus(torch.tensor([[1, 0], [0, 1]]), 0.5), t([[0.5, 0], [0, 0.5]]).float()
    )
    out = algos.length_bonus(torch.tensor([[10, 20]]), max_new_tokens=40, coef=2.0)
    assert torch.allclose(out, torch.tensor([[0.5, 1.0]]))


def test_dagger_sft_scale() -> None:
    assert algos.dagger_sft_scale(3, 4) == 0.75
    assert algos.dagger_sft_scale(0, 0) == 0.0


def _examples(updates: list[int]) -> list[SftExample]:
    return [SftExample(i, u, "p", None, "{}", None) for i, u in enumerate(updates)]


def test_reference_dagger_draw_is_over_every_step() -> None:
    buf = DaggerBuffer(0)
    buf.add(_examples([0] * 100))
    rng = np.random.default_rng(0)
    buf.num_steps = 100  # every step labelled: every draw gives an example
    assert len(buf.sample_reference(8, rng)) == 8
    buf.num_steps = 400  # a quarter labelled: about a quarter of the draws
    hits = sum(len(buf.sample_reference(100, rng)) for _ in range(40))
    assert 850 < hits < 1150  # mean 1000, sd ≈ 27
    assert DaggerBuffer(0).sample_reference(8, rng) == []


def test_latest_sampling_draws_only_the_newest_update() -> None:
    buf = DaggerBuffer(0, "latest")
    buf.add(_examples([0, 0, 1, 2, 2]))
    drawn = buf.sample(50, np.random.default_rng(0))
    assert {e.update_idx for e in drawn} == {2}


def test_output_target_supervises_the_correctors_action() -> None:
    text, span = build_output_target(json.dumps({"thoughts": "go up", "action": "-"}), "+")
    assert span is None and json.loads(text) == {"thoughts": "go up", "action": "+"}


def test_cosine_lr_period_is_a_setting() -> None:
    from services.trainer.service import make_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1e-5)
    cfg = TrainConfig(lr=1e-5, lr_min=1e-9, num_updates=14, lr_schedule_updates=25)
    sched = make_scheduler(opt, cfg)
    for _ in range(13):
        opt.step()
        sched.step()
    # After 13 steps: η = η_min + ½(η − η_min)(1 + cos(π·13/25)), not the floor of a 14-long one.
    want = 1e-9 + 0.5 * (1e-5 - 1e-9) * (1 + math.cos(math.pi * 13 / 25))
    assert math.isclose(opt.param_groups[0]["lr"], want, rel_tol=1e-6)


def test_config_switches_validate() -> None:
    base = {"task": "points24"}
    with pytest.raises(ValueError, match="feedback needs corrector.wait"):
        RunConfig.model_validate({**base, "corrector": {"feedback": True}})
    with pytest.raises(ValueError, match="judge_reward needs"):
        RunConfig.model_validate({**base, "train": {"judge_reward": 1.0}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({**base, "train": {"dagger": "sometimes"}})
    ok = RunConfig.model_validate(
        {**base, "corrector": {"feedback": True, "wait": "step"}, "train": {"judge_reward": 1}}
    )
    assert ok.train.dagger == "labelled" and ok.model.lora_targets == "attention"
    # The VLM-as-judge baseline is PPO on the judge's reward: an rl4vlm run then calls the
    # corrector, which a plain rl4vlm run never does.
    judge = {"train": {"judge_reward": 1.0}, "corrector": {"wait": "update"}}
    assert RunConfig.model_validate({**base, "algorithm": "rl4vlm", **judge}).uses_corrector
    assert not RunConfig.model_validate({**base, "algorithm": "rl4vlm"}).uses_corrector


def test_presets_follow_their_papers() -> None:
    p24 = RunConfig.from_toml(ROOT / "configs/points24-llava7b-gpu.toml")
    assert p24.env.early_truncation and p24.train.lr_schedule_updates == 25
    assert p24.model.lora_targets == "all_linear" and p24.model.value_head == "mlp"
    assert p24.train.dagger == "reference" and p24.train.ratio_guard == "reference"
    assert p24.corrector.feedback and p24.generation.repetition_scope == "generated"
    qwen = RunConfig.from_toml(ROOT / "configs/numberline-qwen2vl7b-gpu.toml")
    assert (
        "Qwen2-VL" in (ROOT / "configs/numberline-qwen2vl7b-gpu.toml").read_text().splitlines()[0]
    )
    assert qwen.train.lr_schedule_updates == 25 and qwen.model.lora_targets == "all_linear"
    # RL4VLM had no format bonus: every rl4vlm run of the study (base config + the arm's
    # changes, as bench/reproduce.py builds it) trains without one, GPU configs included.
    with open(ROOT / "configs/repro/arms.toml", "rb") as f:
        rl4vlm = tomllib.load(f)["rl4vlm"]
    bases = [p for p in (ROOT / "configs/repro").rglob("*.toml") if p.stem in TASKS]
    assert len(bases) >= 4
    for path in bases:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
        for key, value in rl4vlm.items():
            if key != "description":
                section, _, field = key.rpartition(".")
                (cfg.setdefault(section, {}) if section else cfg)[field] = value
        run = RunConfig.model_validate(cfg)
        assert run.algorithm == "rl4vlm" and run.train.format_reward == 0.0, path
        if "gpu" in path.parts:  # the paper's training switches, as the GPU presets
            assert run.train.dagger == "reference" and run.model.value_head == "mlp"


def test_generated_repetition_penalty_leaves_prompt_tokens_alone() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    from services.policy.heads import GeneratedRepetitionPenalty

    scores = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    ids = torch.tensor([[3, 0, 1, 1]])  # prompt = [3, 0]; generated = [1, 1]
    out = GeneratedRepetitionPenalty(2.0, prompt_len=2)(ids, scores.clone())
    # Only token 1 was generated: −1 · 2 = −2 (once, however often it repeats).
    assert torch.equal(out, torch.tensor([[2.0, -2.0, 0.5, 3.0]]))
    # HF's built-in also pushes down the prompt's tokens 3 and 0: 3/2, 2/2.
    hf = RepetitionPenaltyLogitsProcessor(2.0)(ids, scores.clone())
    assert torch.equal(hf, torch.tensor([[1.0, -2.0, 0.5, 1.5]]))
    first = GeneratedRepetitionPenalty(2.0, prompt_len=4)(ids, scores.clone())
    assert torch.equal(first, scores)  # nothing generated yet


def test_vllm_lora_rank_cap_holds_the_papers_rank() -> None:
    from services.policy.vllm_backend import lora_rank_cap

    assert lora_rank_cap(128) == 128 and lora_rank_cap(16) == 16 and lora_rank_cap(100) == 128
    with pytest.raises(ValueError):
        lora_rank_cap(1024)


def test_value_heads_start_at_zero_with_the_reference_shape() -> None:
    from services.policy.heads import make_value_head

    mlp = make_value_head("mlp", 8)
    assert [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [1024, 512, 1]
    image = make_value_head("mlp+image", 8)
    assert image[0].in_features == 16  # [h_last ; mean image hidden]
    assert torch.equal(mlp(torch.randn(3, 8)), torch.zeros(3, 1))
    with pytest.raises(ValueError):
        make_value_head("cnn", 8)


def test_trainer_ranks_draw_different_sft_examples(tiny_dir: Path) -> None:
    from services.policy.service import Policy
    from services.trainer.service import Trainer

    policy = Policy.load(tiny_dir, finetune="full")
    ranks = [
        Trainer(
            policy,
            TrainConfig(),
            seed=3,
            image_loader=lambda s: None,
            accelerator=SimpleNamespace(process_index=r, num_processes=2),
        )
        for r in (0, 1)
    ]
    # Same minibatch permutation on both ranks (each takes its share), other DAgger draws.
    assert torch.equal(
        torch.randperm(50, generator=ranks[0].torch_gen),
        torch.randperm(50, generator=ranks[1].torch_gen),
    )
    assert not np.array_equal(
        ranks[0].rng.integers(0, 10**6, 8), ranks[1].rng.integers(0, 10**6, 8)
    )


def test_vision_lora_and_image_value_head_train(tiny_dir: Path) -> None:
    from services.policy.service import Policy
    from services.trainer.service import Trainer
    from tests.services.trainer.conftest import put_image, rollout_of

    torch.manual_seed(0)
    policy = Policy.load(
        tiny_dir, lora_r=4, lora_targets="all_linear+vision", value_head="mlp+image"
    )
    shas = [put_image((200, 0, 0)), put_image((0, 0, 200))]
    texts = [
        json.dumps({"thoughts": "up", "action": "+"}),
        json.dumps({"thoughts": "down", "action": "-"}),
    ]
    rollout = rollout_of(policy, shas, ["go", "go"], texts, [1.0, -1.0], num_envs=2)
    buffer = DaggerBuffer(0, "latest", target="output")
    buffer.add([SftExample(0, 0, "go", shas[0], texts[0], None)])
    buffer.num_steps = 1
    train = TrainConfig(
        num_envs=2,
        num_steps=1,
        minibatch_size=2,
        ppo_epochs=1,
        lr=1e-2,
        dagger="reference",
        ratio_guard="reference",
        sft_schedule="cosine",
    )
    trainer = Trainer(policy, train, "gtr", seed=0)
    vision_b = {
        n: p.detach().clone()
        for n, p in policy.model.named_parameters()
        if "vision_tower" in n and "lora_B" in n
    }
    metrics = trainer.update(rollout, buffer)
    assert vision_b and np.isfinite(metrics["losses/sft"]) and metrics["sft_coef"] == 1.0
    after = dict(policy.model.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in vision_b.items())  # the CLIP tower moved
    assert any(bool(p.abs().sum() > 0) for p in policy.value_head[-1].parameters())
