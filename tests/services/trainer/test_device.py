"""Device placement the CUDA path depends on, checked on the CPU: everything the trainer builds
for a minibatch follows the trainer's device, never the CPU it was read on (tests/cuda runs the
real thing on a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.policy.service import Policy
from services.trainer.service import Trainer
from shared.schemas import TrainConfig
from tests.services.trainer.conftest import put_image, rollout_of

TEXTS = ['{"thoughts": "one", "action": "+"}', '{"thoughts": "two", "action": "-"}']


def test_advantages_and_minibatches_follow_the_trainers_device(tiny_dir: Path) -> None:
    policy = Policy.load(tiny_dir, finetune="full")
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    rollout = rollout_of(policy, shas, ["go", "go"], TEXTS, [1.0, -1.0], num_envs=2)
    train = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=1)
    trainer = Trainer(policy, train, "gtr", seed=0)
    # The meta device stands in for a GPU: a tensor left where numpy made it stays on the CPU.
    trainer.device = torch.device("meta")
    adv, ret = trainer.compute_advantages(rollout)
    assert adv.device.type == ret.device.type == "meta"
    [batch] = list(trainer.minibatches(rollout, adv, ret))
    tensors = {k: v for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    assert set(tensors) >= {"old_logprobs", "thought_mask", "action_mask", "eos_mask", "returns"}
    assert {k: v.device.type for k, v in tensors.items()} == dict.fromkeys(tensors, "meta")
    assert sorted(np.asarray(batch.idx).tolist()) == [0, 1]


def test_a_gpus_auto_dtype_is_mixed_precision_with_fp32_trained_weights() -> None:
    from services.policy.loading import resolve_precision

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    # LoRA: the frozen base in bf16 (peft's adapters are fp32); full: fp32 master weights
    assert resolve_precision("auto", gpu, "lora") == (torch.bfloat16, True)
    assert resolve_precision("auto", gpu, "full") == (torch.float32, True)
    assert resolve_precision("auto", cpu, "full") == (torch.float32, False)
    assert resolve_precision("bfloat16", gpu, "full") == (torch.bfloat16, False)
    assert resolve_precision("float32", gpu, "lora") == (torch.float32, False)


def test_an_update_under_bf16_autocast_keeps_fp32_weights_and_small_steps(tiny_dir: Path) -> None:
    """The GPU's mixed precision, run on the CPU's bf16 autocast: the forward passes in bf16,
    the weights and AdamW's steps in fp32, so a step far under bf16's resolution still lands
    (a bf16 weight would round it away)."""
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="full")
    policy.amp = True
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    rollout = rollout_of(policy, shas, ["go", "go"], TEXTS, [1.0, -1.0], num_envs=2)
    with torch.no_grad():
        out = policy.score(
            [np.zeros((64, 64, 3), np.uint8)], ["go"], [policy.encode_response(TEXTS[0])]
        )
    assert torch.isfinite(out.logprobs).all()
    train = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=1, lr=1e-6)
    trainer = Trainer(policy, train, "gtr", seed=0)
    before = [p.detach().clone() for p in trainer.params]
    assert all(p.dtype == torch.float32 for p in trainer.params)
    metrics = trainer.update(rollout, None)
    assert np.isfinite(metrics["losses/policy"]), metrics
    moved = [not torch.equal(a, p.detach()) for a, p in zip(before, trainer.params, strict=True)]
    assert sum(moved) > 0.5 * len(moved)
    # the same steps applied to bf16 weights: nearly all of them round away
    w16 = torch.cat([a.bfloat16().flatten() for a in before])
    d16 = torch.cat(
        [(p.detach() - a).bfloat16().flatten() for a, p in zip(before, trainer.params, strict=True)]
    )
    stepped = d16 != 0
    assert stepped.sum() > 0
    lost = ((w16 + d16) == w16) & stepped
    assert lost.sum() > 0.9 * stepped.sum(), (int(lost.sum()), int(stepped.sum()))
