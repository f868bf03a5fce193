"""Policy: generate/score agreement, spans, LoRA, checkpoints (tiny models, CPU)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.policy.service import Policy
from services.policy.spans import token_spans
from shared.schemas import ModelConfig

from .conftest import PROMPTS

NL = {
    "current number": 3,
    "target number": 5,
    "thoughts": "3 is below 5, so I choose '+'",
    "action": "+",
}
EZ = {"cards": [4, 3], "formula": "4", "thoughts": "4 * 3 = 12, next I append '*'", "action": "*"}


@pytest.fixture(scope="module")
def llava(tiny_path: Callable[[str], Path]) -> Path:
    return tiny_path("llava")


def _sft_step(policy: Policy, images: list[np.ndarray], lr: float = 1e-2) -> None:
    """One AdamW step on an SFT + value loss (what the trainer does, in miniature)."""
    targets = [policy.encode_response(json.dumps(d)) for d in (NL, EZ, NL)]
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr)
    out = policy.score(images, PROMPTS, targets, with_grad=True)
    loss = -(out.logprobs * out.mask).sum() / out.mask.sum() + (out.values - 1).pow(2).mean()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_generate_then_score_agree(
    arch: str, tiny_path: Callable[[str], Path], images: list[np.ndarray]
) -> None:
    policy = Policy.load(tiny_path(arch), lora_r=4)
    _sft_step(policy, images)  # non-zero value head and adapter
    gens = policy.generate(
        images,
        PROMPTS,
        temperature=0.7,
        top_p=0.9,
        repetition_penalty=1.2,
        max_new_tokens=24,
        seed=3,
    )
    out = policy.score(images, PROMPTS, [g.token_ids for g in gens], temperature=0.7)
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        assert 0 < n <= 24 and len(g.logprobs) == len(g.entropy) == len(g.thought_mask) == n
        assert out.mask[i].sum() == n
        assert torch.allclose(out.logprobs[i, :n], torch.tensor(g.logprobs), atol=1e-4)
        assert torch.allclose(out.entropy[i, :n], torch.tensor(g.entropy), atol=1e-4)
        assert abs(float(out.values[i]) - g.value) < 1e-4 and g.value != 0.0
        assert not set(g.token_ids) & set(policy.suppress_ids)
        assert g.finished == (policy.eos_id in g.token_ids)


def test_sampling_is_seeded_and_greedy_is_deterministic(
    llava: Path, images: list[np.ndarray]
) -> None:
    policy = Policy.load(llava)
    a = policy.generate(images, PROMPTS, max_new_tokens=16, seed=7)
    b = policy.generate(images, PROMPTS, max_new_tokens=16, seed=7)
    c = policy.generate(images, PROMPTS, max_new_tokens=16, seed=8)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    g1 = policy.generate(images, PROMPTS, greedy=True, max_new_tokens=16, seed=1)
    g2 = policy.generate(images, PROMPTS, greedy=True, max_new_tokens=16, seed=2)
    assert [g.token_ids for g in g1] == [g.token_ids for g in g2]


def _char_tokenizer(extra: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer with no merges (one token per character) plus `extra` whole-string tokens."""
    chars = sorted(set("".join(json.dumps(d) for d in (NL, EZ))) | set(" {}"))
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(["<eos>", *chars])}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    tok.add_tokens(extra)
    return tok


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """Metaspace (SentencePiece-style) BPE in which whole words like `"action":` are one token."""
    from tokenizers import trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    lines = [json.dumps(d) for d in (NL, EZ, {"thoughts": "hit", "action": "hit"})] * 20
    tk.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


def _check_spans(tok: object, text: str) -> None:
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    ids = [*tok.encode(text, add_special_tokens=False), eos]  # type: ignore[attr-defined]
    thought, action, has_action = token_spans(tok, ids, eos)
    assert has_action and not thought[-1] and not action[-1]  # EOS in neither
    assert not any(t and a for t, a in zip(thought, action, strict=True))
    first_action = action.index(True)
    assert all(thought[:first_action]) and all(action[first_action:-1])
    key = text.index('"action"')
    before = tok.decode(ids[:first_action])  # type: ignore[attr-defined]
    assert len(before) <= key and text.startswith(before)
    assert '"action":' in tok.decode(ids[first_action:-1])  # type: ignore[attr-defined]
    assert len(tok.decode(ids[: first_action + 1])) > key  # type: ignore[attr-defined]


@pytest.mark.parametrize("sample", [NL, EZ, {"thoughts": "hit", "action": "hit"}])
def test_spans_from_character_offsets_for_several_tokenizers(
    llava: Path, sample: dict[str, object]
) -> None:
    text = json.dumps(sample)
    policy = Policy.load(llava)
    _check_spans(policy.tokenizer, text)
    _check_spans(_char_tokenizer([]), text)  # the key is 9 tokens
    _check_spans(_char_tokenizer(['", "action": "']), text)  # one token straddles the key
    sp = _sentencepiece_like()
    assert '▁"action":' in sp.convert_ids_to_tokens(sp.encode(text))  # the key is one token
    _check_spans(sp, text)
    ids = policy.encode_response(text)
    assert ids[-1] == policy.eos_id
    assert policy.spans(ids) == token_spans(policy.tokenizer, ids, policy.eos_id)[:2]
    straddle = _char_tokenizer(['", "action": "'])
    ids = straddle.encode(text, add_special_tokens=False)
    token = straddle.convert_tokens_to_ids('", "action": "')
    assert token in ids and token_spans(straddle, ids, None)[1][ids.index(token)]


def test_spans_without_action_key(llava: Path) -> None:
    policy = Policy.load(llava)
    for text in ['{"thoughts": "no action here"}', '{"current number": 3, "act": "+"}', ""]:
        ids = policy.encode_response(text)
        thought, action, has_action = token_spans(policy.tokenizer, ids, policy.eos_id)
        assert not has_action and not any(action)
        assert thought == [t != policy.eos_id for t in ids]


def test_lora_adapts_only_the_language_model(llava: Path, images: list[np.ndarray]) -> None:
    policy = Policy.load(llava, lora_r=4, lora_target_modules=r".*\.(q_proj|v_proj|fc1)")
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("language_model" in n and "lora_" in n for n in names)
    assert not any("vision" in n for n in names)  # fc1 exists only in the CLIP tower
    base = {
        n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad
    }
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    _sft_step(policy, images)
    after = dict(policy.model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items())
    assert any(not torch.equal(after[n], v) for n, v in lora.items() if "lora_B" in n)
    assert float(policy.value_head.bias) != 0.0
    with pytest.raises(ValueError, match="matches no LM Linear"):
        Policy.load(llava, lora_target_modules=r".*vision_tower.*")
    cfg = ModelConfig(lora_r=2, lora_alpha=4, lora_target_modules=r".*language_model.*\.o_proj")
    from_cfg = Policy.from_config(cfg, llava)
    lora_names = [n for n, p in from_cfg.model.named_parameters() if p.requires_grad]
    assert lora_names and all("o_proj" in n for n in lora_names)
    assert from_cfg.lora is not None and from_cfg.lora["r"] == 2


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_save_then_load_weights_restores_the_policy(
    llava: Path, images: list[np.ndarray], tmp_path: Path, finetune: str
) -> None:
    policy = Policy.load(llava, finetune=finetune, lora_r=4)  # type: ignore[arg-type]
    if finetune == "lora":
        for p in policy.vision_parameters():  # a vision warm-up: saved with the checkpoint
            p.requires_grad_(True)
    _sft_step(policy, images)
    targets = [policy.encode_response(json.dumps(NL))] * 3
    want = policy.score(images, PROMPTS, targets)
    policy.save(tmp_path / "ckpt")
    fresh = Policy.load(llava, finetune=finetune, lora_r=4, seed=5)  # type: ignore[arg-type]
    assert not torch.allclose(fresh.score(images, PROMPTS, targets).logprobs, want.logprobs)
    fresh.load_weights(tmp_path / "ckpt")
    got = fresh.score(images, PROMPTS, targets)
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-6)
    assert torch.allclose(got.values, want.values, atol=1e-6)
    meta = json.loads((tmp_path / "ckpt" / "policy.json").read_text())
    assert meta["finetune"] == finetune


def test_load_weights_rejects_other_checkpoints(llava: Path, tmp_path: Path) -> None:
    policy = Policy.load(llava, lora_r=4)
    with pytest.raises(FileNotFoundError):
        policy.load_weights(tmp_path)
    policy.save(tmp_path / "r4")
    with pytest.raises(ValueError, match="rank"):
        Policy.load(llava, lora_r=8).load_weights(tmp_path / "r4")
    with pytest.raises(ValueError, match="lora"):
        Policy.load(llava, finetune="full").load_weights(tmp_path / "r4")


def test_an_sft_step_moves_the_scores_and_features_have_grad(
    llava: Path, images: list[np.ndarray]
) -> None:
    policy = Policy.load(llava, lora_r=4)
    targets = [policy.encode_response(json.dumps(EZ))] * 3
    base = policy.score(images, PROMPTS, targets).logprobs
    _sft_step(policy, images)
    assert not torch.allclose(policy.score(images, PROMPTS, targets).logprobs, base)
    params = policy.vision_parameters()
    for p in params:
        p.requires_grad_(True)
    feats = policy.image_features(images)
    assert feats.shape == (3, 16, 128)
    feats.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
