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
