"""SFT samples from an exported run (``gtr export``): the corrections of one run become the
warm-start data of the next (``gtr sft CONFIG --dataset EXPORT``)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.trainer.warmstart import OracleSample


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    if path.is_dir():  # --format hf
        from datasets import load_from_disk

        yield from load_from_disk(str(path))
    elif path.suffix == ".parquet":
        from datasets import load_dataset

        yield from load_dataset("parquet", data_files=str(path), split="train")
    else:  # jsonl
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def _image(row: dict[str, Any]) -> np.ndarray | None:
    img = row.get("image")
    if img is None and row.get("image_png_b64"):
        img = Image.open(io.BytesIO(base64.b64decode(row["image_png_b64"])))
    if isinstance(img, dict) and img.get("bytes"):
        img = Image.open(io.BytesIO(img["bytes"]))
    return np.asarray(img.convert("RGB")) if isinstance(img, Image.Image) else None


def dataset_samples(path: Path, agreed: bool = True) -> list[OracleSample]:
    """Each step with a corrected output (``target``) and, when ``agreed``, each step the
    corrector judged correct (its own output), as (frame, prompt, text) SFT samples."""
    out = []
    for row in _rows(Path(path)):
        own = row.get("output") if agreed and row.get("verdict") == "correct" else None
        text = row.get("target") or own
        image = _image(row)
        if text and image is not None:
            out.append(OracleSample(image, row["prompt"], {}, text))
    return out
