"""`gtr model init-pretrained`: a VLM on the real SmolLM2-135M-Instruct GGUF weights, saved as
an ordinary HF folder that ``model.path`` loads (a 2-layer slice: the ``smol_dir`` fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner
from safetensors import safe_open

from services.cli import main
from services.policy.pretrained import build_pretrained, default_gguf
from services.policy.service import Policy

IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def _weight(folder: Path, name: str) -> torch.Tensor:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def test_the_folder_is_an_hf_checkpoint_with_the_real_tokenizer(smol_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json"):
        assert (smol_dir / name).is_file(), name
    assert (smol_dir / "chat_template.jinja").is_file()
    cfg = AutoConfig.from_pretrained(smol_dir)
    text = cfg.text_config
    assert cfg.model_type == "idefics3" and text.model_type == "llama"
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (2, 576, 49152 + 4)
    tok = AutoTokenizer.from_pretrained(smol_dir)
    assert len(tok) == 49152 + 4 and tok.eos_token == "<|im_end|>"
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<image>") >= 49152
    # The image tokens are single special tokens; English stays English word pieces.
    for t in IMAGE_TOKENS:
        assert tok.convert_tokens_to_ids(t) >= 49152
    words = tok.tokenize("next I append the card")
    assert len(words) == 5, words
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    source = json.loads((smol_dir / "gtr_source.json").read_text())
    assert source["gguf"] == default_gguf().name and source["layers"] == 2
    assert len(source["gguf_sha256"]) == 64


def test_model_path_loads_it_like_any_checkpoint(smol_dir: Path) -> None:
    policy = Policy.load(smol_dir, finetune="lora", lora_r=4)
    assert policy.model_type == "idefics3"
    assert policy.eos_id == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_ids = [policy.tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]
    assert set(image_ids) <= set(policy.suppress_ids)  # never sampled
    assert policy.eos_id not in policy.suppress_ids
    rendered = policy.render("Hello")
    assert rendered == "<|im_start|>user\n<image>Hello<|im_end|>\n<|im_start|>assistant\n"
    image = np.zeros((64, 64, 3), np.uint8)
    ids = policy._inputs([image], ["Hello"])["input_ids"][0].tolist()
    assert ids.count(policy.tokenizer.convert_tokens_to_ids("<image>")) == 16  # 64 px / 8 / 2
    assert ids[0] == policy.tokenizer.convert_tokens_to_ids("<|im_start|>")  # no extra BOS
    gen = policy.generate([image], ["Hello"], max_new_tokens=6, seed=0)[0]
    assert gen.token_ids and not set(gen.token_ids) & set(image_ids)
    # Embedding and output head stay tied, as in SmolLM2.
    base = policy.base_model
    assert base.lm_head.weight is base.model.text_model.embed_tokens.weight


def test_the_language_model_holds_the_gguf_weights_dequantized(smol_dir: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(default_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, ours in (
        ("blk.1.ffn_down.weight", "model.text_model.layers.1.mlp.down_proj.weight"),
        ("blk.0.ffn_gate.weight", "model.text_model.layers.0.mlp.gate_proj.weight"),
    ):
        t = tensors[gguf_name]
        want = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), np.float32))
        got = _weight(smol_dir, ours)
        assert got.shape == want.shape and torch.equal(got, want), gguf_name
    embed = tensors["token_embd.weight"]  # rows by token id; the first thousand are enough
    rows = np.asarray(dequantize(embed.data[:1000], embed.tensor_type), np.float32)
    got = _weight(smol_dir, "model.text_model.embed_tokens.weight")
    assert got.shape[0] == 49152 + 4  # the 4 image tokens come after the real vocabulary
    assert torch.equal(got[:1000], torch.from_numpy(rows))


def test_a_local_hf_language_model_folder_works_too(smol_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    # An HF causal-LM folder: the slice's language model and tokenizer, as a lab would have one.
    text = AutoConfig.from_pretrained(smol_dir).text_config
    lm = LlamaForCausalLM(text)
    state = {
        k.removeprefix("model.text_model."): _weight(smol_dir, k)
        for k in ("model.text_model.embed_tokens.weight", "model.text_model.norm.weight")
    }
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith("model.text_model.layers."):
                state[k.removeprefix("model.text_model.")] = f.get_tensor(k)
    lm.model.load_state_dict(state)
    lm_dir = tmp_path / "lm"
    lm.save_pretrained(lm_dir)
    AutoTokenizer.from_pretrained(smol_dir).save_pretrained(lm_dir)
    out = build_pretrained(tmp_path / "vlm", hf_dir=lm_dir, image_size=32, seed=1)
    name = "model.text_model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(_weight(out, name), _weight(smol_dir, name))
    assert json.loads((out / "gtr_source.json").read_text())["hf_dir"] == str(lm_dir.resolve())
    assert AutoConfig.from_pretrained(out).text_config.vocab_size == 49152 + 4


def test_bad_sources_are_one_line_errors(tmp_path: Path, smol_dir: Path) -> None:
    runner = CliRunner()
    cases = [
        (["--gguf", str(tmp_path / "none.gguf")], "--gguf: no file at"),
        (["--gguf", str(tmp_path / "a.gguf"), "--hf", str(tmp_path)], "not both"),
        (["--hf", str(tmp_path)], "holds no config.json"),
        (["--image-size", "40"], "multiple of 16"),
    ]
    for args, message in cases:
        result = runner.invoke(main, ["model", "init-pretrained", str(tmp_path / "out"), *args])
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, result.output
    taken = runner.invoke(main, ["model", "init-pretrained", str(smol_dir)])
    assert taken.exit_code == 1 and "already holds a model" in taken.output
