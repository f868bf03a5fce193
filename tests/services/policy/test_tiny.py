"""Tiny models: real architectures, save/reload fidelity, a tokenizer that fits the envs' JSON."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from services.policy.loading import load_processor
from services.policy.tiny import make_tiny

from .conftest import PROMPTS


def _logits(
    model: torch.nn.Module, processor: object, arch: str, images: list[np.ndarray]
) -> torch.Tensor:
    from PIL import Image

    pil = [Image.fromarray(im) for im in images]
    imgs = [[im] for im in pil] if arch == "idefics3" else pil
    tok = processor.tokenizer  # type: ignore[attr-defined]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for p in PROMPTS
    ]
    batch = processor(images=imgs, text=texts, return_tensors="pt", padding=True)  # type: ignore[operator]
    with torch.no_grad():
        return model.eval()(**batch).logits


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_build_save_reload_gives_identical_logits(
    arch: str, tiny_path: Callable[[str], Path], corpus: list[str], images: list[np.ndarray]
) -> None:
    path = tiny_path(arch)  # built by build_tiny(seed=0) with this corpus
    model, processor = make_tiny(arch, "1m", 64, corpus, seed=0)
    reloaded = AutoModelForImageTextToText.from_pretrained(path)
    assert type(reloaded) is type(model)
    before = _logits(model, processor, arch, images)
    after = _logits(reloaded, load_processor(path, reloaded.config), arch, images)
    assert before.shape == after.shape
    assert torch.equal(before, after)
    other, _ = make_tiny(arch, "1m", 64, corpus, seed=1)
    assert not torch.equal(_logits(other, processor, arch, images), before)


def test_tokenizer_pieces_fit_the_json(tiny_path: Callable[[str], Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_path("llava"))
    for n in range(14):  # every number an env shows is one token (with or without a space)
        assert len(tok.encode(f" {n}", add_special_tokens=False)) == 1, n
        assert len(tok.encode(str(n), add_special_tokens=False)) == 1, n
    pieces = tok.convert_ids_to_tokens(tok.encode('"action": "10"}', add_special_tokens=False))
    assert pieces[-2:] == ["10", '"}']
    for value in ["stand", "hit"]:
        ids = tok.encode(f'", "action": "{value}"}}', add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids)[-2:] == [value, '"}']  # the value is one piece
        assert tok.decode(ids) == f'", "action": "{value}"}}'
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_default_corpus_comes_from_the_env_experts() -> None:
    from services.policy.tiny import _default_corpus, train_tokenizer

    lines = list(_default_corpus(60, seed=1))
    assert len(lines) == 120 and any('"action":' in line for line in lines)
    tok = train_tokenizer(lines, "llava")
    output = next(line for line in lines if line.startswith('{"cards"'))
    pieces = tok.convert_ids_to_tokens(tok.encode(output, add_special_tokens=False))
    assert pieces[-1] == '"}' or pieces[-1].endswith('"}')
    assert "action" in pieces


def test_bad_arguments_are_rejected(corpus: list[str]) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_tiny("gpt2", "1m", 64, corpus)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 16"):
        make_tiny("llava", "1m", 72, corpus)
    with pytest.raises(ValueError, match="corpus"):
        make_tiny("llava", "1m", 64, [])


def test_a_second_build_keeps_the_model_in_place(tmp_path: Path, corpus: list[str]) -> None:
    """Two runs of a study starting together both build the missing base model: the second
    finds the first's folder and keeps it, bytes and times untouched, so nothing is rewritten
    under a reader and the warm-start cache's key does not change under the first run. A
    rebuild elsewhere gives the same key (the tiny model is fingerprinted by content); an
    explicit overwrite replaces the files. No half-written folder is left behind."""
    from services.policy.tiny import build_tiny
    from services.trainer.warmcache import model_fingerprint

    def files(folder: Path) -> dict[str, tuple[int, bytes]]:
        return {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in folder.iterdir()}

    out = tmp_path / "model"
    assert build_tiny(out, "llava", "1m", corpus=corpus) == out
    first = files(out)
    assert "model.safetensors" in first
    assert build_tiny(out, "llava", "1m", corpus=corpus) == out
    assert files(out) == first
    elsewhere = build_tiny(tmp_path / "elsewhere", "llava", "1m", corpus=corpus)
    assert model_fingerprint(elsewhere) == model_fingerprint(out)
    build_tiny(out, "llava", "1m", corpus=corpus, seed=1, overwrite=True)
    assert files(out)["model.safetensors"][1] != first["model.safetensors"][1]
    assert model_fingerprint(out) != model_fingerprint(elsewhere)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "model"]
