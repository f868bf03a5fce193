"""The KV cache that grows in place: the same keys, values and generations as HF's dynamic
cache, written without copying the cache at every decode step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from services.policy.kv_cache import CACHE_ARG, MIN_ROOM, GrowingLayer, growing_cache
from services.policy.service import Policy

from .conftest import PROMPTS


def _kv(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, length, 8, generator=g), torch.randn(3, 2, length, 8, generator=g)


def test_a_decode_step_writes_in_place_and_the_keys_are_every_step_in_order() -> None:
    layer = GrowingLayer()
    ks, vs = [], []
    buffers = set()
    for step in range(300):
        k, v = _kv(20 if step == 0 else 1, step)  # a prefill of 20, then one token a step
        keys, values = layer.update(k, v)
        ks.append(k)
        vs.append(v)
        buffers.add(keys.data_ptr())
        assert torch.equal(keys, torch.cat(ks, dim=-2)) and torch.equal(
            values, torch.cat(vs, dim=-2)
        )
    assert layer.get_seq_length() == 319
    # 319 positions from room for 128, doubled when full: three buffers, not one per step.
    assert MIN_ROOM == 128 and layer.reallocations == len(buffers) == 3


def test_what_hf_does_to_the_keys_between_steps_is_kept() -> None:
    """crop (assisted decoding) and batch selection replace `keys`: the next step continues
    from what they left, not from the buffer's older contents."""
    layer = GrowingLayer()
    k0, v0 = _kv(10, 0)
    layer.update(k0, v0)
    layer.crop(-4)
    k1, v1 = _kv(1, 1)
    keys, values = layer.update(k1, v1)
    assert torch.equal(keys, torch.cat([k0[..., :6, :], k1], dim=-2))
    layer.batch_select_indices(torch.tensor([2, 0]))
    k2, v2 = _kv(1, 2)
    keys, values = layer.update(k2[:2], v2[:2])
    want = torch.cat([k0[..., :6, :], k1], dim=-2)[[2, 0]]
    assert torch.equal(keys, torch.cat([want, k2[:2]], dim=-2))
    layer.reset()
    keys, _ = layer.update(k1, v1)
    assert torch.equal(keys, k1)


@pytest.fixture(scope="module")
def policy(tiny_path: Callable[[str], Path]) -> Policy:
    return Policy.load(tiny_path("llava"), lora_r=4)


@pytest.mark.parametrize("greedy", [True, False])
def test_generations_match_hf_dynamic_cache(
    policy: Policy, images: list[np.ndarray], greedy: bool
) -> None:
    """A padded batch of three prompts, 120 new tokens (past the first buffer's 128 positions):
    the same tokens and the same logits."""
    gcfg = GenerationConfig(
        do_sample=not greedy,
        max_new_tokens=120,
        min_new_tokens=120,
        eos_token_id=policy.eos_id,
        pad_token_id=policy.pad_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    inputs = policy._inputs(images, PROMPTS)
    outs = []
    for cache in ({}, {CACHE_ARG: growing_cache(policy.model.config)}):
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(policy.model.generate(**inputs, generation_config=gcfg, **cache))
    hf, ours = outs
    assert torch.equal(hf.sequences, ours.sequences)
    assert torch.allclose(torch.stack(hf.logits), torch.stack(ours.logits), atol=1e-5)


def test_the_policy_generates_with_the_growing_cache(policy: Policy) -> None:
    """What Policy.generate hands the model: one growing layer per decoder layer."""
    cache = policy._cache_kwargs()[CACHE_ARG]
    layers = policy.model.config.get_text_config(decoder=True).num_hidden_layers
    assert len(cache.layers) == layers and all(isinstance(x, GrowingLayer) for x in cache.layers)
