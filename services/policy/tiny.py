"""Tiny random-weight VLMs of the real architectures, with a tokenizer trained on the envs' text.

`build_tiny(out_dir, arch, size, image_size, corpus, seed)` writes a folder that loads with
`from_pretrained` like a hub checkpoint (model + tokenizer + processor + chat template).
Recipe and presets: ``offline-models.md`` and ``tiny-numberline.md`` (S=64 / patch 16 for llava).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

ARCHS = ("llava", "qwen2_vl", "idefics3")
SIZES = ("1m", "10m", "50m")
Arch = Literal["llava", "qwen2_vl", "idefics3"]
Size = Literal["1m", "10m", "50m"]

# text d / layers / heads / mlp, vision d / layers / heads (offline-models.md §2)
PRESETS: dict[str, dict[str, int]] = {
    "1m": {"d": 128, "L": 3, "H": 4, "I": 384, "vd": 64, "vL": 2, "vH": 2},
    "10m": {"d": 256, "L": 8, "H": 4, "I": 768, "vd": 192, "vL": 4, "vH": 4},
    "50m": {"d": 512, "L": 12, "H": 8, "I": 1536, "vd": 384, "vL": 6, "vH": 6},
}
BASE_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS_SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
IMAGE_MARK = {
    "llava": "<image>",
    "idefics3": "<image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
# ChatML; an image part renders as the architecture's placeholder, expanded by the processor.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}@IMG@{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny(
    out_dir: str | Path,
    arch: Arch = "llava",
    size: Size = "1m",
    image_size: int = 64,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Build, save and return the folder of a random-weight `arch` model of preset `size`.

    The folder appears whole: it is written beside ``out_dir`` and renamed into place. When
    ``out_dir`` already holds a model by then (another process built the same one first) that
    model is kept, unless ``overwrite``: a model in use is never rewritten under its readers,
    and its files keep the times the warm-start cache's key may read (warmcache.py)."""
    model, processor = make_tiny(arch, size, image_size, corpus, seed)
    return save_whole(Path(out_dir), model, processor, overwrite)


def save_whole(
    out: Path, model: Any, processor: Any, overwrite: bool, extra: dict[str, str] | None = None
) -> Path:
    """Save a model, its processor and tokenizer (and ``extra`` text files by name) so that the
    folder appears whole: written beside ``out`` and renamed into place; a model already at
    ``out`` is kept unless ``overwrite``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        processor.tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        try:
            os.rename(tmp, out)  # atomic; fails when out exists and is not an empty folder
        except OSError:
            if overwrite or not (out / "config.json").exists():
                for f in tmp.iterdir():
                    os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_tiny(
    arch: Arch = "llava",
    size: Size = "1m",
    image_size: int = 64,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> tuple[Any, Any]:
    """(model, processor) of a tiny random-weight `arch`; deterministic for a given `seed`."""
    import torch

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    lines = list(corpus) if corpus is not None else list(_default_corpus())
    if not lines:
        raise ValueError("the tokenizer corpus is empty")
    tok = train_tokenizer(lines, arch)
    torch.manual_seed(seed)
    builder = {"llava": _llava, "qwen2_vl": _qwen2_vl, "idefics3": _idefics3}[arch]
    model, processor = builder(tok, PRESETS[size], image_size)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.bos_token_id,
    )
    return model, processor


def _default_corpus(n: int = 2000, seed: int = 0) -> Iterator[str]:
    try:
        from services.env.expert import corpus
    except ImportError as e:  # the env service writes it; say so instead of a bare traceback
        raise RuntimeError(
            f"services.env.expert.corpus is unavailable ({e}); give a corpus (CLI: --corpus FILE)"
        ) from e
    return corpus(n, seed)


def train_tokenizer(lines: list[str], arch: str, vocab_size: int = 1024) -> Any:
    """Byte-level BPE on the corpus; specials for `arch`; ChatML template; EOS = <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = BASE_SPECIALS + (QWEN_SPECIALS if arch == "qwen2_vl" else IDEFICS_SPECIALS)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.normalizer = normalizers.NFKC()
    # GPT-2 splitting keeps digits apart from punctuation and makes `"}` / ` "+"}` single pieces.
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        # its progress bar goes straight to fd 1 (Rust), as blank lines in the CLI's output
        show_progress=False,
    )
    # Digits 0..13 and JSON punctuation always get their own pieces, however small the corpus.
    seeds = [str(i) for i in range(14)] + ['{"', '": "', '", "', '"}', '": [', "], ", '": ']
    tk.train_from_iterator(lines + seeds * 4, trainer)
    image_token = "<|image_pad|>" if arch == "qwen2_vl" else "<image>"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        extra_special_tokens={"image_token": image_token},
    )
    tok.chat_template = CHAT_TEMPLATE.replace("@IMG@", IMAGE_MARK[arch])
    return tok


def _llama_kwargs(tok: Any, p: dict[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": len(tok),
        "hidden_size": p["d"],
        "intermediate_size": p["I"],
        "num_hidden_layers": p["L"],
        "num_attention_heads": p["H"],
        "num_key_value_heads": p["H"],
        "max_position_embeddings": 2048,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
    }


def _llava(tok: Any, p: dict[str, int], image_size: int) -> tuple[Any, Any]:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    patch = 16 if image_size <= 128 else 32
    _check_divisible(image_size, patch)
    vcfg = CLIPVisionConfig(
        hidden_size=p["vd"],
        intermediate_size=4 * p["vd"],
        num_hidden_layers=p["vL"],
        num_attention_heads=p["vH"],
        image_size=image_size,
        patch_size=patch,
        projection_dim=p["vd"],
    )
    cfg = LlavaConfig(
        vision_config=vcfg,
        text_config=LlamaConfig(**_llama_kwargs(tok, p)),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(image_size // patch) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    improc = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    proc = LlavaProcessor(
        image_processor=improc,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=tok.chat_template,
        image_token="<image>",
        num_additional_image_tokens=1,  # +CLS, dropped by "default"
    )
    return LlavaForConditionalGeneration(cfg), proc


def _qwen2_vl(tok: Any, p: dict[str, int], image_size: int) -> tuple[Any, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    from services.policy.processors import TinyQwen2VLProcessor

    patch, merge = 8, 2  # 64 px -> 8x8 patches -> 16 merged image tokens
    _check_divisible(image_size, patch * merge)
    head_dim = p["d"] // p["H"]
    third = head_dim // 2 // 3
    mrope = [head_dim // 2 - 2 * third, third, third]
    text = _llama_kwargs(tok, p) | {
        "rope_parameters": {"rope_type": "default", "mrope_section": mrope, "rope_theta": 1e4},
    }
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    vision = {
        "depth": p["vL"],
        "embed_dim": p["vd"],
        "hidden_size": p["d"],
        "num_heads": p["vH"],
        "patch_size": patch,
        "spatial_merge_size": merge,
        "temporal_patch_size": 2,
        "mlp_ratio": 4,
    }
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    improc = Qwen2VLImageProcessor(
        min_pixels=image_size * image_size,
        max_pixels=image_size * image_size,
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
    )
    proc = TinyQwen2VLProcessor(
        image_processor=improc, tokenizer=tok, chat_template=tok.chat_template
    )
    return Qwen2VLForConditionalGeneration(cfg), proc


def _idefics3(tok: Any, p: dict[str, int], image_size: int) -> tuple[Any, Any]:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )

    patch, scale = 8, 2  # 64 px -> 8x8 patches -> pixel shuffle x2 -> 16 image tokens
    _check_divisible(image_size, patch * scale)
    seq_len = (image_size // patch) ** 2 // scale**2
    vision = {
        "hidden_size": p["vd"],
        "intermediate_size": 4 * p["vd"],
        "num_hidden_layers": p["vL"],
        "num_attention_heads": p["vH"],
        "image_size": image_size,
        "patch_size": patch,
    }
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=LlamaConfig(**_llama_kwargs(tok, p)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale,
        tie_word_embeddings=False,
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
        image_seq_len=seq_len,
        chat_template=tok.chat_template,
    )
    return Idefics3ForConditionalGeneration(cfg), proc


def _check_divisible(image_size: int, unit: int) -> None:
    if image_size % unit or image_size < unit:
        raise ValueError(f"image_size must be a positive multiple of {unit}, got {image_size}")
