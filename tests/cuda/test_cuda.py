"""The CUDA path: the policy's generate and score, a trainer update (LoRA and full fine-tuning under
bf16 autocast with fp32 trained weights, the ``dtype = "auto"`` of a GPU) and a short embedded
run, on a CUDA device.

Marked ``cuda``: deselected by default (pyproject addopts) and skipped without a GPU, so CI
never runs them; on a GPU machine: ``pytest -m cuda tests/cuda``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.service import Policy
from services.trainer.buffer import DaggerBuffer, SftExample
from services.trainer.service import Trainer, blob_image_loader
from shared.rollout import Rollout
from shared.schemas import TrainConfig
from tests.e2e.helpers import ROOT, tiny_config
from tests.services.trainer.conftest import put_image

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["Where is the card?", "Pick the next number."]
TARGET = '{"thoughts": "the card is a 7, so I append 7", "action": "7"}'


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in PROMPTS]


def test_generate_and_score_run_on_the_gpu_in_bf16(tiny_model_dir: Path) -> None:
    policy = Policy.load(tiny_model_dir, finetune="lora", lora_r=4)
    # mixed precision: the frozen base in bf16, the adapters and value head fp32, bf16 autocast
    assert policy.device.type == "cuda" and policy.dtype == torch.bfloat16 and policy.amp
    assert all(p.device.type == "cuda" for p in policy.trainable_parameters())
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    images = _images()
    sampled = policy.generate(images, PROMPTS, max_new_tokens=16, seed=0)
    greedy = policy.generate(images, PROMPTS, max_new_tokens=16, greedy=True)
    for g in sampled + greedy:
        assert 0 < len(g.token_ids) <= 16 and np.isfinite(g.value)
        assert not set(g.token_ids) & set(policy.suppress_ids)
    out = policy.score(images, PROMPTS, [g.token_ids for g in sampled])
    assert out.logprobs.device.type == "cuda" and out.values.device.type == "cuda"
    for i, g in enumerate(sampled):
        n = len(g.token_ids)
        # bf16 forward passes of another shape (a decode step vs the whole sequence): close,
        # not equal
        got = out.logprobs[i, :n].float().cpu()
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=0.1), (got, g.logprobs)


def _rollout(policy: Policy, shas: list[str], texts: list[str], rewards: list[float]) -> Rollout:
    """A rollout of given responses, scored by the policy on the GPU as the controller would."""
    load = blob_image_loader()
    ids = [policy.encode_response(t) for t in texts]
    out = policy.score([load(s) for s in shas], PROMPTS, ids)
    spans = [policy.spans(x) for x in ids]
    padded, lengths = Rollout.pad_responses(ids, pad_id=policy.pad_id)
    mask = lambda k: Rollout.pad_responses([s[k] for s in spans], 0, bool)[0]  # noqa: E731
    n = len(texts)
    return Rollout(
        num_envs=n,
        num_steps=1,
        step_ids=np.arange(n, dtype=np.int64),
        prompts=np.array(PROMPTS),
        image_shas=np.array(shas),
        response_ids=padded,
        response_lengths=lengths,
        old_logprobs=out.logprobs.float().cpu().numpy()[:, : padded.shape[1]],
        thought_mask=mask(0),
        action_mask=mask(1),
        values=out.values.float().cpu().numpy(),
        rewards=np.array(rewards, np.float32),
        dones=np.ones(n, bool),
        format_valid=np.ones(n, bool),
        actions=np.array(["7"] * n),
        last_values=np.zeros(n, np.float32),
        pad_id=policy.pad_id,
    )


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_gtr_update_trains_on_the_gpu_in_bf16(tiny_model_dir: Path, finetune: str) -> None:
    torch.manual_seed(0)
    policy = Policy.load(tiny_model_dir, finetune=finetune, lora_r=4)  # type: ignore[arg-type]
    assert policy.amp and policy.dtype == (torch.float32 if finetune == "full" else torch.bfloat16)
    shas = [put_image((0, 0, 0)), put_image((255, 255, 255))]
    rollout = _rollout(policy, shas, [TARGET, '{"action": "+"}'], [1.0, -1.0])
    buffer = DaggerBuffer(run_id=0)
    start = TARGET.rindex('"7"')
    buffer.add([SftExample(i, 0, p, s, TARGET, (start, start + 3)) for i, (p, s) in
                enumerate(zip(PROMPTS, shas, strict=True))])  # fmt: skip
    train = TrainConfig(num_envs=2, num_steps=1, minibatch_size=2, ppo_epochs=2, lr=1e-3)
    trainer = Trainer(policy, train, "gtr", seed=0)
    assert trainer.device.type == "cuda"
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.update(rollout, buffer)
    for key in ("losses/policy", "losses/value", "losses/sft", "grad_norm", "approx_kl"):
        assert np.isfinite(metrics[key]), (key, metrics)
    moved = sum(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.params, strict=True))
    assert moved > 0.5 * len(before)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in trainer.params)
    for state in trainer.optimizer.state.values():  # AdamW's moments live beside the weights
        assert all(t.device.type == "cuda" for t in state.values() if t.dim() > 0)


def test_an_embedded_run_trains_on_the_gpu(tmp_path: Path, warm_checkpoint: Path) -> None:
    from safetensors import safe_open

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tiny_config(warm_checkpoint, envs=2, steps=4, updates=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(tmp_path / "data"), "GTR_TORCH_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "completed" in proc.stdout
    # The trainer's checkpoints hold its weights as trained: fp32 (mixed precision's master
    # weights; under LoRA the frozen bf16 base is not what a checkpoint stores).
    [last] = (tmp_path / "data").rglob("update-00001/model.safetensors")
    with safe_open(str(last), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert torch.float32 in dtypes, dtypes
