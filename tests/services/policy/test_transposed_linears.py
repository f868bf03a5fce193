"""Decoding through transposed weights: the same generations as nn.Linear's own path, the weights
a training step or a checkpoint left (never a stale copy), and nn.Linear restored after."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from services.policy.service import Policy
from services.policy.transposed_linears import TransposedLinears

from .conftest import PROMPTS


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_the_policy_decodes_every_language_model_linear_through_it(
    tiny_path: Callable[[str], Path], images: list[np.ndarray], arch: str
) -> None:
    """Every architecture (Qwen2's q/k/v carry a bias): the same greedy generations either way."""
    policy = Policy.load(tiny_path(arch), lora_r=4)
    linears = policy.transposed_linears
    assert linears is not None  # on the CPU
    base = policy.base_model
    lm = [m for m in base.get_decoder().modules() if isinstance(m, nn.Linear)]
    assert lm and set(lm) <= set(linears.modules)
    assert base.get_output_embeddings() in linears.modules
    lora = [n for n, m in policy.model.named_modules() if isinstance(m, nn.Linear) and "lora_" in n]
    assert lora and all(policy.model.get_submodule(n) in linears.modules for n in lora)
    biased = [m.bias for m in lm if m.bias is not None]
    assert bool(biased) == (arch == "qwen2_vl")
    with torch.no_grad():  # a built model's biases start at 0: make them count
        for b in biased:
            b.normal_(0.0, 0.5)
    assert _same(_greedy(policy, images, on=True), _greedy(policy, images, on=False))


def _greedy(policy: Policy, images: list[np.ndarray], on: bool) -> list[tuple[list[int], list]]:
    held = policy.transposed_linears
    policy.transposed_linears = held if on else None
    try:
        gens = policy.generate(images, PROMPTS, greedy=True, max_new_tokens=24)
    finally:
        policy.transposed_linears = held
    return [(g.token_ids, g.logprobs) for g in gens]


def _same(a: list[tuple[list[int], list]], b: list[tuple[list[int], list]]) -> bool:
    return all(
        ia == ib and np.allclose(la, lb, atol=1e-5) for (ia, la), (ib, lb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_generations_follow_the_weights_after_a_training_step_and_a_checkpoint(
    tiny_path: Callable[[str], Path], images: list[np.ndarray], tmp_path: Path, finetune: str
) -> None:
    policy = Policy.load(tiny_path("llava"), finetune=finetune, lora_r=4)  # type: ignore[arg-type]
    saved = policy.save(tmp_path / "before")
    before = _greedy(policy, images, on=True)
    assert _same(before, _greedy(policy, images, on=False))

    # A large SGD step on the responses' log-likelihood, in place as the trainer's optimiser does.
    targets = [policy.encode_response('{"action": "+"}')] * len(PROMPTS)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=5.0)
    out = policy.score(images, PROMPTS, targets, with_grad=True)
    (-(out.logprobs * out.mask).sum()).backward()
    opt.step()
    after = _greedy(policy, images, on=True)
    assert not _same(after, before)  # the step changed what the model says...
    assert _same(after, _greedy(policy, images, on=False))  # ...and decoding saw the new weights

    policy.load_weights(saved)
    assert _same(_greedy(policy, images, on=True), before)


def test_outside_the_context_and_after_an_error_nn_linear_is_back() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 5)
    x = torch.randn(3, 2, 8)
    fast = TransposedLinears([lin])
    with torch.no_grad():
        want = lin(x)
        with fast.active():
            assert "forward" in lin.__dict__
            assert torch.allclose(lin(x), want, atol=1e-6)  # bias included, 3-D input
        assert "forward" not in lin.__dict__
        with pytest.raises(ValueError), fast.active():
            raise ValueError("a failing generation")
        assert "forward" not in lin.__dict__
    with pytest.raises(RuntimeError, match="no-grad"), fast.active():
        pass
