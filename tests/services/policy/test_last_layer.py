"""``score`` with the last decoder layer at the read positions only (services/policy/last_layer.py)
against HF's whole layer: the same log-probs, entropies, values and gradients of every trainable
parameter, for every tiny architecture, LoRA and full fine-tuning, each value head's reads; and
the whole layer wherever the module does not handle the model or the call."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy.last_layer import ResponseLastLayer, kept_positions
from services.policy.loading import language_model
from services.policy.service import Policy, ScoreOutput
from services.policy.tiny import ARCHS

from .conftest import PROMPTS

RESPONSES = ['{"thoughts": "go up", "action": "+"}', '{"action": "-"}', "x"]


@pytest.fixture(autouse=True)
def _switch_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests build the switch on purpose, whatever the module's default."""
    from services.policy import last_layer

    monkeypatch.setattr(last_layer, "ENABLED", True)


def _policy(path: Path, finetune: str, value_head: str = "linear") -> Policy:
    """A policy whose every trained piece counts: LoRA's B, the biases and the value head start
    at 0 in a fresh model, which would hide a wrong gradient or a wrong read behind zeros."""
    policy = Policy.load(path, finetune=finetune, lora_r=4, value_head=value_head)  # type: ignore[arg-type]
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name or name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for p in policy.value_head.parameters():
            p.normal_(0.0, 0.3)
    return policy


@contextmanager
def _query_rows(policy: Policy) -> Iterator[list[int]]:
    """How many positions each call of the last layer's query projection gets."""
    layer = language_model(policy.base_model).layers[-1]
    rows: list[int] = []
    handle = layer.self_attn.q_proj.register_forward_hook(
        lambda _m, args, _o: rows.append(args[0].shape[1])
    )
    try:
        yield rows
    finally:
        handle.remove()


def _score(
    policy: Policy,
    images: list[np.ndarray],
    prompts: list[str],
    texts: list[str],
    *,
    on: bool,
) -> tuple[ScoreOutput, list[torch.Tensor | None], list[int]]:
    """score with grad, switch on or off; the gradients of a loss that reads all three outputs."""
    held = policy.response_last_layer
    policy.response_last_layer = held if on else None
    params = policy.trainable_parameters()
    for p in params:
        p.grad = None
    try:
        with _query_rows(policy) as rows:
            out = policy.score(
                images, prompts, [policy.encode_response(t) for t in texts], with_grad=True
            )
    finally:
        policy.response_last_layer = held
    ((out.logprobs * out.mask).sum() + out.entropy.sum() + out.values.sum()).backward()
    return out, [None if p.grad is None else p.grad.clone() for p in params], rows


def _assert_same(
    a: tuple[ScoreOutput, list[torch.Tensor | None], list[int]],
    b: tuple[ScoreOutput, list[torch.Tensor | None], list[int]],
    rtol: float = 1e-5,
) -> None:
    """Outputs within ``rtol``; each gradient within ``rtol`` of its tensor's largest entry (+1e-6
    for a gradient that is 0 but for rounding: a key's bias, which softmax ignores)."""
    (out_a, grads_a, _), (out_b, grads_b, _) = a, b
    for key in ("logprobs", "entropy", "values", "mask"):
        x, y = getattr(out_a, key).detach(), getattr(out_b, key).detach()
        assert torch.allclose(x, y, rtol=rtol, atol=rtol * float(y.abs().max())), key
    assert [g is None for g in grads_a] == [g is None for g in grads_b]
    pairs = [(x, y) for x, y in zip(grads_a, grads_b, strict=True) if x is not None]
    assert pairs and any(float(y.abs().max()) > 0 for _, y in pairs)
    for x, y in pairs:
        assert y is not None
        assert float((x - y).abs().max()) <= rtol * float(y.abs().max()) + 1e-6


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("finetune", "value_head"), [("lora", "linear"), ("full", "mlp+image")])
def test_score_and_gradients_are_the_whole_layers(
    tiny_path: Callable[[str], Path],
    images: list[np.ndarray],
    arch: str,
    finetune: str,
    value_head: str,
) -> None:
    """Prompts of different lengths (left padding) and responses of different lengths (right
    padding); the image head also reads the image tokens' outputs of the last layer."""
    policy = _policy(tiny_path(arch), finetune, value_head)
    assert policy.response_last_layer is not None  # every tiny architecture is handled
    on = _score(policy, images, PROMPTS, RESPONSES, on=True)
    off = _score(policy, images, PROMPTS, RESPONSES, on=False)
    _assert_same(on, off)
    longest = max(len(policy.encode_response(t)) for t in RESPONSES)
    seq = off[2][0]  # prompt + response: every position's query
    n_image = int((policy._inputs(images, PROMPTS)["input_ids"] == policy._image_token).sum(1)[0])
    read = longest + 1 + (n_image if value_head == "mlp+image" else 0)
    assert off[2] == [seq] and on[2] == [read] and read < seq, (on[2], off[2])


def test_one_unpadded_row_under_sdpas_causal_mask(
    tiny_path: Callable[[str], Path], images: list[np.ndarray]
) -> None:
    """One row: no padding, so HF hands sdpa no mask at all (its causal flag instead), which the
    layer's queries from the last prompt position on must not read as top-left causal."""
    policy = _policy(tiny_path("llava"), "lora")
    one = ([images[0]], [PROMPTS[1]], [RESPONSES[0]])
    on = _score(policy, *one, on=True)
    _assert_same(on, _score(policy, *one, on=False))
    assert on[2] == [len(policy.encode_response(RESPONSES[0])) + 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_under_eager_attention(
    tiny_path: Callable[[str], Path], images: list[np.ndarray], arch: str
) -> None:
    """The model's own eager attention, its additive float mask's rows."""
    policy = _policy(tiny_path(arch), "lora")
    policy.base_model.set_attn_implementation("eager")
    assert language_model(policy.base_model).config._attn_implementation == "eager"
    on = _score(policy, images, PROMPTS, RESPONSES, on=True)
    _assert_same(on, _score(policy, images, PROMPTS, RESPONSES, on=False))
    assert on[2] == [max(len(policy.encode_response(t)) for t in RESPONSES) + 1]


def test_under_bf16_autocast(tiny_path: Callable[[str], Path], images: list[np.ndarray]) -> None:
    """The GPU's mixed precision on the CPU's bf16 autocast: the same figures to bf16's
    rounding (products over other row counts round differently), and the layer's products
    in bf16."""
    policy = _policy(tiny_path("llava"), "full")
    policy.amp = True
    layer = language_model(policy.base_model).layers[-1]
    dtypes: list[torch.dtype] = []
    handle = layer.mlp.register_forward_hook(lambda _m, _a, out: dtypes.append(out.dtype))
    try:
        on = _score(policy, images, PROMPTS, RESPONSES, on=True)
    finally:
        handle.remove()
    off = _score(policy, images, PROMPTS, RESPONSES, on=False)
    assert dtypes == [torch.bfloat16] and on[2][0] < off[2][0]
    assert torch.allclose(on[0].logprobs, off[0].logprobs, atol=0.05)
    assert torch.allclose(on[0].values, off[0].values, rtol=0.02, atol=0.02)


def test_a_model_it_does_not_handle_runs_the_whole_layer(
    tiny_path: Callable[[str], Path], images: list[np.ndarray], tmp_path: Path
) -> None:
    """A LLaVA whose language model is a Mistral (a decoder layer the module does not know):
    no switch, every position through the last layer, scores as usual."""
    path = tmp_path / "mistral"
    shutil.copytree(tiny_path("llava"), path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    (path / "config.json").write_text(json.dumps(config))
    policy = Policy.load(path)
    assert type(language_model(policy.base_model).layers[-1]).__name__ == "MistralDecoderLayer"
    assert policy.response_last_layer is None
    with _query_rows(policy) as rows:
        out = policy.score(images, PROMPTS, [policy.encode_response(t) for t in RESPONSES])
    assert torch.isfinite(out.logprobs[out.mask.bool()]).all()
    prompt = policy._inputs(images, PROMPTS)["input_ids"].shape[1]
    assert rows == [prompt + out.mask.shape[1]]  # every position of prompt and response


def test_a_call_with_a_kv_cache_runs_the_whole_layer(
    tiny_path: Callable[[str], Path], images: list[np.ndarray]
) -> None:
    """Decoding (a cache) while the switch is active: HF's own forward, the same generations."""
    policy = Policy.load(tiny_path("qwen2_vl"), lora_r=4)
    held = policy.response_last_layer
    assert held is not None
    want = policy.generate(images, PROMPTS, greedy=True, max_new_tokens=8)
    with held.active(0, None), _query_rows(policy) as rows:
        got = policy.generate(images, PROMPTS, greedy=True, max_new_tokens=8)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    prompt = policy._inputs(images, PROMPTS)["input_ids"].shape[1]
    assert rows[0] == prompt and rows[1:] == [1] * (len(rows) - 1)  # prefill: every position
    assert "forward" not in held.layer.__dict__  # its own forward back after


def test_kept_positions() -> None:
    cpu = torch.device("cpu")
    assert kept_positions(2, 6, 3, None, cpu).tolist() == [[3, 4, 5], [3, 4, 5]]
    assert kept_positions(1, 6, -1, None, cpu).tolist() == [[5]]
    image = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool).unsqueeze(-1)
    assert kept_positions(2, 7, 4, image, cpu).tolist() == [[1, 2, 4, 5, 6], [2, 3, 4, 5, 6]]
    # rows with different image counts: everything from the earliest image token on
    uneven = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool).unsqueeze(-1)
    assert kept_positions(2, 6, 4, uneven, cpu).tolist() == [[1, 2, 3, 4, 5]] * 2


def test_the_switch_restores_the_layer_after_an_error(tiny_path: Callable[[str], Path]) -> None:
    policy = Policy.load(tiny_path("idefics3"), lora_r=4)
    held = policy.response_last_layer
    assert isinstance(held, ResponseLastLayer)
    with pytest.raises(ValueError), held.active(0, None):
        assert "forward" in held.layer.__dict__
        raise ValueError("a failing score")
    assert "forward" not in held.layer.__dict__
