"""The update loop on the tiny model: SFT clones thoughts, PPO follows the advantage sign,
and a resumed trainer continues exactly as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from services.policy.service import Policy
from services.trainer.buffer import DaggerBuffer, SftExample
from services.trainer.checkpoint import load_checkpoint, trainer_state, write_checkpoint
from services.trainer.service import Trainer, blob_image_loader, encode_target
from shared.schemas import TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TARGETS = [
    {"current": 2, "target": 7, "thoughts": "I am at 2, the target is 7, so I move +"},
    {"current": 8, "target": 1, "thoughts": "I am at 8, the target is 1, so I move -"},
]


def output(fields: dict, action: str) -> str:
    return json.dumps({**fields, "action": action})


def sft_examples(shas: list[str]) -> list[SftExample]:
    out = []
    for i, (sha, fields) in enumerate(zip(shas, TARGETS, strict=True)):
        text = output(fields, "+")
        start = text.rindex('"+"')
        out.append(SftExample(i, 0, "go", sha, text, (start, start + 3)))
    return out


def cfg(**kw) -> TrainConfig:
    base = {
        "num_envs": 2,
        "num_steps": 1,
        "num_updates": 50,
        "ppo_epochs": 1,
        "minibatch_size": 2,
        "lr": 3e-3,
        "lr_schedule": "constant",
        "max_grad_norm": 1.0,
        "thought_coef": 0.5,
    }
    return TrainConfig(**{**base, **kw})


def test_sft_mask_supervises_everything_but_the_action_value(tiny_dir: Path) -> None:
    policy = Policy.load(tiny_dir, finetune="full")
    text = output(TARGETS[0], "+")
    start = text.rindex('"+"')
    ids, mask = encode_target(policy, text, (start, start + 3))
    masked = policy.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
    assert '"+"' in masked and "thoughts" not in masked and "target" not in masked
    assert ids[-1] == policy.eos_id and mask[-1] == 1  # EOS is supervised


def test_sft_on_corrections_lowers_the_loss_and_greedy_reproduces_the_thought(
    tiny_dir: Path,
) -> None:
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    buffer = DaggerBuffer(run_id=0)
    buffer.add(sft_examples(shas))
    trainer = Trainer(policy, cfg(ppo_epochs=5), "sft_only", seed=0)
    rollout = rollout_of(policy, shas, ["go", "go"], ["x", "y"], [0.0, 0.0], num_envs=2)
    first = trainer.update(rollout, buffer)["losses/sft"]
    for _ in range(9):  # 50 optimiser steps in all
        last = trainer.update(rollout, buffer)["losses/sft"]
    assert last < 0.2 * first
    load = blob_image_loader()
    gens = policy.generate([load(s) for s in shas], ["go", "go"], greedy=True, max_new_tokens=48)
    for gen, fields in zip(gens, TARGETS, strict=True):
        assert gen.text.split(', "action"')[0] == output(fields, "+").split(', "action"')[0]
    # The action value is not supervised, but EOS after it is: after the agent's action the
    # model ends its output.
    ids = [policy.encode_response(output(f, "+")) for f in TARGETS]
    scored = policy.score([load(s) for s in shas], ["go", "go"], ids)
    for row, x in enumerate(ids):
        assert scored.logprobs[row, len(x) - 1] > np.log(0.5)


def test_ppo_step_follows_the_sign_of_the_advantage(tiny_dir: Path) -> None:
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((200, 0, 0)), put_image((0, 0, 200))]
    texts = [output(TARGETS[0], "+"), output(TARGETS[1], "-")]
    rollout = rollout_of(policy, shas, ["go", "go"], texts, [1.0, -1.0], num_envs=2)
    trainer = Trainer(policy, cfg(lr=1e-3), "rl4vlm", seed=0)
    metrics = trainer.update(rollout)
    for key in (
        "losses/policy",
        "losses/value",
        "approx_kl",
        "clipfrac",
        "lr",
        "grad_norm",
        "explained_variance",
    ):
        assert np.isfinite(metrics[key]), key
    after = rollout_of(policy, shas, ["go", "go"], texts, [0.0, 0.0], num_envs=2)
    seq = lambda r: (r.old_logprobs * (r.thought_mask * 0.5 + r.action_mask)).sum(1)  # noqa: E731
    before_lp, after_lp = seq(rollout), seq(after)
    assert after_lp[0] > before_lp[0] + 1e-3  # positive advantage: more likely
    assert after_lp[1] < before_lp[1] - 1e-3  # negative advantage: less likely


def _weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()} | {
        f"value_head.{k}": v.detach().clone() for k, v in policy.value_head.state_dict().items()
    }


def test_resume_equals_uninterrupted_training(tiny_dir: Path, tmp_path: Path) -> None:
    shas = [put_image((10, 200, 10)), put_image((200, 200, 10))]
    texts = [output(TARGETS[0], "+"), output(TARGETS[1], "-")]
    conf = cfg(
        lr=1e-3, lr_schedule="cosine", num_updates=4, ppo_epochs=2, minibatch_size=1, grad_accum=2
    )

    def fresh() -> tuple[Trainer, DaggerBuffer]:
        buffer = DaggerBuffer(run_id=0)
        buffer.add(sft_examples(shas))
        policy = Policy.load(tiny_dir, finetune="lora", lora_dropout=0.0, seed=0)
        return Trainer(policy, conf, "gtr", seed=3), buffer

    a, buf_a = fresh()
    r1 = rollout_of(a.policy, shas, ["go", "go"], texts, [1.0, -1.0], num_envs=2)
    a.update(r1, buf_a)
    r2 = rollout_of(a.policy, shas, ["go", "go"], texts, [-1.0, 1.0], num_envs=2)
    a.update(r2, buf_a)

    b, buf_b = fresh()
    b.update(r1, buf_b)
    write_checkpoint(b.policy, tmp_path / "ckpt", trainer_state(b))
    c, buf_c = fresh()
    load_checkpoint(c, tmp_path / "ckpt")
    assert c.update_idx == 0 and c.scheduler.last_epoch == 1
    c.update(r2, buf_c)

    wa, wc = _weights(a.policy), _weights(c.policy)
    assert wa.keys() == wc.keys()
    moved = 0
    for key in wa:
        torch.testing.assert_close(wa[key], wc[key], rtol=1e-5, atol=1e-6, msg=key)
        moved += "lora_" in key
    assert moved and a.optimizer.param_groups[0]["lr"] == c.optimizer.param_groups[0]["lr"]


def test_clip_per_loss_keeps_sft_learning_under_a_huge_ppo_gradient(tiny_dir: Path) -> None:
    # Returns of ±300 give the value loss a gradient thousands of times the SFT one: clipped
    # together, the SFT share of the step all but vanishes; clipped apart, SFT keeps its size.
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    texts = [output(TARGETS[0], "-"), output(TARGETS[1], "+")]

    def sft_after(per_loss: bool) -> tuple[float, dict[str, float]]:
        torch.manual_seed(0)
        policy = Policy.load(tiny_dir, finetune="full")
        buffer = DaggerBuffer(run_id=0)
        buffer.add(sft_examples(shas))
        trainer = Trainer(policy, cfg(clip_per_loss=per_loss, ppo_epochs=8), "gtr", seed=0)
        rollout = rollout_of(policy, shas, ["go", "go"], texts, [300.0, -300.0], num_envs=2)
        first = trainer.update(rollout, buffer)  # later on, both PPO clips cut the gradient
        for _ in range(4):
            last = trainer.update(rollout, buffer)
        return last["losses/sft"], first

    together, m_together = sft_after(False)
    apart, m_apart = sft_after(True)
    assert "grad_norm/sft" not in m_together and m_apart["grad_norm/sft"] > 0
    assert m_apart["grad_norm"] > 100 * m_apart["grad_norm/sft"]  # the premise: PPO dominates
    assert apart < 0.5 * together
    # Every update records the SFT term's gradient and its share of the applied step: drowned
    # under the single clip, its own half of the step when each part is clipped apart.
    assert m_together["sft/grad_norm"] > 0 and m_apart["sft/grad_norm"] > 0
    assert 0 < m_together["sft/grad_share"] < m_apart["sft/grad_share"] <= 1


def test_a_variant_leaves_the_arms_it_lists_as_unchanged_exactly_as_they_were(
    tiny_dir: Path,
) -> None:
    """configs/repro/variants.toml's `unchanged`: the study runs no such arm under the variant
    and shows its base run instead, so the variant's train settings must not move its weights."""
    import tomllib

    repro = Path(__file__).resolve().parents[3] / "configs" / "repro"
    variants = tomllib.loads((repro / "variants.toml").read_text())
    arms = tomllib.loads((repro / "arms.toml").read_text())
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    texts = [output(TARGETS[0], "-"), output(TARGETS[1], "+")]

    def weights(algorithm: str, changes: dict) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        policy = Policy.load(tiny_dir, finetune="full")
        buffer = DaggerBuffer(run_id=0)
        buffer.add(sft_examples(shas))
        trainer = Trainer(policy, cfg(ppo_epochs=2, **changes), algorithm, seed=0)
        rollout = rollout_of(policy, shas, ["go", "go"], texts, [300.0, -300.0], num_envs=2)
        for _ in range(2):
            trainer.update(rollout, buffer)
        state = policy.base_model.state_dict() | {
            f"value_head.{k}": v for k, v in policy.value_head.state_dict().items()
        }
        return {k: v.detach().clone() for k, v in state.items()}

    checked = 0
    for name, variant in variants.items():
        changes = {
            k.removeprefix("train."): v for k, v in variant.items() if k.startswith("train.")
        }
        for arm in variant.get("unchanged", []):
            assert set(variant) - {"description", "unchanged"} == {f"train.{k}" for k in changes}
            algorithm = arms[arm].get("algorithm", "gtr")
            before, after = weights(algorithm, {}), weights(algorithm, changes)
            for key in before:
                assert torch.equal(before[key], after[key]), (name, arm, key)
            checked += 1
    assert checked >= 2  # clip_per_loss on sft_only and rl4vlm at least
    # The comparison can fail: the same variant does move GTR, which has both gradients.
    clip = {"clip_per_loss": True}
    gtr_before, gtr_after = weights("gtr", {}), weights("gtr", clip)
    assert any(not torch.equal(gtr_before[k], gtr_after[k]) for k in gtr_before)


def test_value_head_has_its_own_learning_rate(tiny_dir: Path) -> None:
    policy = Policy.load(tiny_dir, finetune="lora")
    trainer = Trainer(policy, cfg(lr=1e-4, value_lr=1e-2), "rl4vlm", seed=0)
    body, head = trainer.optimizer.param_groups
    assert body["lr"] == 1e-4 and head["lr"] == 1e-2
    assert {id(p) for p in head["params"]} == {id(p) for p in policy.value_head.parameters()}
    same = Trainer(policy, cfg(lr=1e-4), "rl4vlm", seed=0).optimizer.param_groups
    assert [g["lr"] for g in same] == [1e-4, 1e-4]
