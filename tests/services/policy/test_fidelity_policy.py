"""Policy-side switches of docs/fidelity.md: LoRA presets, value heads, the last action key,
the generated-only repetition penalty, checkpoints that carry their value-head kind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.service import Policy
from services.policy.spans import token_spans
from tests.services.policy.conftest import PROMPTS


@pytest.fixture(scope="module")
def llava(tiny_path: Callable[[str], Path]) -> Path:
    return tiny_path("llava")


def test_spans_split_at_the_last_action_key(llava: Path) -> None:
    policy = Policy.load(llava)
    # A model that wrote the key twice: the reference scores the last one as the action.
    text = '{"thoughts": "go up", "action": "-", "action": "+"}'
    ids = policy.encode_response(text)
    thought, action, has = token_spans(policy.tokenizer, ids, policy.eos_id)
    assert has
    before = policy.tokenizer.decode(ids[: action.index(True)])
    assert before.count('"action":') == 1 and text.startswith(before)
    assert len(before) <= text.rindex('"action":')
    assert sum(thought) + sum(action) == len(ids) - 1  # EOS in neither


def test_lora_presets_widen_from_attention_to_vision(llava: Path) -> None:
    def adapted(preset: str) -> set[str]:
        p = Policy.load(llava, lora_r=2, lora_targets=preset)
        return {n.split(".lora_")[0] for n, q in p.model.named_parameters() if q.requires_grad}

    attn, lm, vision = adapted("attention"), adapted("all_linear"), adapted("all_linear+vision")
    assert attn < lm < vision
    assert all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in attn)
    assert any("mlp" in n for n in lm - attn)  # the MLP's Linears (the reference)
    assert all("language_model" in n for n in lm)
    assert any("vision_tower" in n for n in vision) and any("projector" in n for n in vision)
    assert not any("lm_head" in n for n in vision)


def test_image_value_head_same_value_in_generate_and_score(
    llava: Path, images: list[np.ndarray], tmp_path: Path
) -> None:
    policy = Policy.load(llava, value_head="mlp+image", finetune="full")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.value_head.parameters():
            p.normal_(0, 0.5)
    gens = policy.generate(images, PROMPTS, max_new_tokens=6, seed=0, repetition_penalty=1.3)
    scored = policy.score(images, PROMPTS, [g.token_ids for g in gens])
    # Both paths read the same hidden states: last prompt token + mean over image tokens.
    assert torch.allclose(torch.tensor([g.value for g in gens]), scored.values, atol=1e-4)
    assert len({round(g.value, 4) for g in gens}) == 3  # three images, three values
    policy.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "policy.json").read_text())["value_head"] == "mlp+image"
    linear = Policy.load(llava, finetune="full")
    with pytest.raises(ValueError, match="value head"):
        linear.load_weights(tmp_path / "ckpt")
    linear.load_weights(tmp_path / "ckpt", value_head=False)  # the weights, a fresh head


def test_generated_only_penalty_changes_sampling_not_scores(
    llava: Path, images: list[np.ndarray]
) -> None:
    policy = Policy.load(llava)
    plain = policy.generate(images, PROMPTS, max_new_tokens=12, greedy=True)
    own = policy.generate(images, PROMPTS, max_new_tokens=12, greedy=True, repetition_penalty=3.0)
    # The random tiny model loops greedily; a strong penalty on its own tokens breaks the loops,
    # while the first token (nothing generated yet: the prompt never counts) is unchanged.
    assert any(len(set(g.token_ids)) < len(g.token_ids) for g in plain)
    assert all(len(set(g.token_ids)) == len(g.token_ids) for g in own)
    assert [g.token_ids[0] for g in own] == [g.token_ids[0] for g in plain]
    # The log-probs stay those of softmax(logits/T): score reproduces them.
    scored = policy.score(images, PROMPTS, [g.token_ids for g in own])
    for i, g in enumerate(own):
        assert np.allclose(g.logprobs, scored.logprobs[i, : len(g.token_ids)].numpy(), atol=1e-4)
