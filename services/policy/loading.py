"""Loading HF checkpoints for the policy: processor, LoRA on the LM only, dtype, threads."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from services.policy.protocol import ImageLike

QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")


def load_processor(path: Path, config: Any) -> Any:
    """The checkpoint's processor; Qwen2-VL via a subclass that needs no torchvision."""
    from transformers import AutoProcessor

    if config.model_type in QWEN_TYPES:
        from services.policy.processors import TinyQwen2VLProcessor

        return TinyQwen2VLProcessor.from_pretrained(path)
    proc = AutoProcessor.from_pretrained(path)
    if config.model_type == "idefics3":  # image_seq_len is not saved with the processor
        v = config.vision_config
        proc.image_seq_len = (v.image_size // v.patch_size) ** 2 // config.scale_factor**2
    return proc


LORA_TARGETS = ("attention", "all_linear", "all_linear+vision")
VISION_PARTS = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector")


def add_lora(model: Any, lora: dict[str, Any]) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = lora_modules(model, lora.get("targets", "attention"), lora["target_modules"])
    if not targets:
        raise ValueError(
            f"lora_target_modules {lora['target_modules']!r} matches no LM Linear layer"
        )
    cfg = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=targets,
        bias="none",
    )
    return get_peft_model(model, cfg)


def lora_modules(model: Any, preset: str, pattern: str) -> list[str]:
    """The Linear layers LoRA adapts under a `lora_targets` preset.

    attention: LM layers matching `pattern` (q/k/v/o by default); all_linear: every LM Linear
    (the reference: MLP included); all_linear+vision: also every Linear of the vision tower and
    projector (the reference's --train-vision all). lm_head and the value head are never adapted.
    """
    if preset == "attention":
        return lm_linear_modules(model, pattern)
    if preset not in LORA_TARGETS:
        raise ValueError(f"lora_targets must be one of {', '.join(LORA_TARGETS)}, got {preset!r}")
    names = lm_linear_modules(model, ".*")
    if preset == "all_linear+vision":
        inner = model.model
        parts = [getattr(inner, n) for n in VISION_PARTS if hasattr(inner, n)]
        ids = {id(m) for part in parts for m in part.modules()}
        names += [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in ids]
    return names


def lm_linear_modules(model: Any, pattern: str) -> list[str]:
    """Names of Linear layers inside the language model whose full name matches `pattern`."""
    lm_ids = {id(m) for m in language_model(model).modules()}
    rx = re.compile(pattern)
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) in lm_ids and rx.fullmatch(name)
    ]


def language_model(model: Any) -> nn.Module:
    inner = model.model
    lm = getattr(inner, "language_model", None) or getattr(inner, "text_model", None)
    if lm is None:
        raise ValueError(f"cannot find the language model of {type(model).__name__}")
    return lm


def suppressed_ids(tokenizer: Any, config: Any) -> list[int]:
    """Every special/added-special token except EOS, plus the config's image/video token ids."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for key in (
        "image_token_id",
        "image_token_index",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ):
        if isinstance(getattr(config, key, None), int):
            ids.add(getattr(config, key))
    ids.discard(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None and i >= 0)


def to_pil(image: ImageLike) -> Image.Image:
    """RGB PIL image from an HxWx3(4) uint8 array or any PIL image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise ValueError(f"an image must be HxWx3 (or 4) uint8, got shape {arr.shape}")
    return Image.fromarray(arr.astype(np.uint8)).convert("RGB")


def resolve_precision(dtype: str, device: torch.device, finetune: str) -> tuple[torch.dtype, bool]:
    """(the weights' dtype, whether forward passes run under bf16 autocast).

    ``auto`` on a GPU is mixed precision: bf16 matrix products under autocast, while the weights
    that train stay fp32. A bf16 weight rounds away any AdamW step under 2^-8 of its size (at
    lr 1e-5 every step), so full fine-tuning loads fp32 weights; under LoRA the base is frozen
    and stays bf16 (peft makes the adapters fp32). ``bfloat16``: every weight bf16, no autocast
    (half the memory of full fine-tuning, lossy steps). On a CPU ``auto`` is fp32: its products
    have no fast bf16 path."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32, False
        return (torch.float32 if finetune == "full" else torch.bfloat16), True
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    return table[dtype], False


def autocast(device: torch.device, enabled: bool) -> torch.autocast:
    """bf16 autocast on ``device`` when ``enabled`` (``resolve_precision``'s second answer)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def set_threads() -> None:
    """Cap intra-op threads (several workers often share a small CPU) and keep freed memory."""
    n = int(os.environ.get("GTR_TORCH_THREADS", min(4, os.cpu_count() or 1)))
    if torch.get_num_threads() != n:
        torch.set_num_threads(max(1, n))
    keep_freed_memory()


# glibc mallopt parameters (malloc.h) and the values set: blocks up to 32 MiB (glibc's cap) come
# from the heap, and up to 256 MiB of freed heap is kept instead of being returned to the OS.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 256 << 20


def keep_freed_memory() -> bool:
    """Serve torch's short-lived CPU tensors from memory the process already has.

    Decoding grows every layer's KV cache by one token per step (a ``torch.cat`` into a new,
    slightly larger block). glibc hands blocks over its mmap threshold out as fresh pages, and
    raises that threshold (from 128 KiB) only to the size of the largest block freed so far: how
    often a step page-faults its whole cache in again depends on what the process freed before.
    Measured on the 10M model at batch 16 (64 tokens): ~10,000 minor faults per call after a
    model build, 400,000 and half the tokens/s where nothing large had been freed, ~0 with these
    fixed thresholds (tests/services/policy/test_loading.py). Returns whether they were set
    (False off glibc, where this is a no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # musl and other libcs: no mallopt, keep their defaults
        return False
