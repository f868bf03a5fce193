"""Policy service wire types, and the torch-free `Generation` record shared with the client."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, Field

from services.env.schemas import StepOut
from shared.frames import decode_raw, encode_raw, is_raw

MAX_SAMPLES = 64  # per request
# A request of MAX_SAMPLES raw frames must fit: 64 frames of 300 px (the GPU presets) are ~23 MB
# of base64, 448 px ~51 MB. The API's 8 MiB refused a 64-env rollout at 300 px with 413.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_PROMPT_CHARS = 8000
MAX_B64_CHARS = 8_000_000
MAX_ROLLOUT_STEPS = 4096  # per POST /rollout


@dataclass
class Generation:
    """One sampled response and everything PPO needs about it (lists are per response token)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]  # log softmax(logits / temperature) over allowed tokens
    value: float  # value head on the last prompt token
    thought_mask: list[bool]  # tokens wholly before the `"action":` key
    action_mask: list[bool]  # from the key to the end, EOS excluded
    entropy: list[float]
    has_action: bool = False  # the `"action":` key was produced
    finished: bool = False  # ended with EOS (not cut by max_new_tokens)


class Sampling(BaseModel):
    temperature: float = Field(1.0, gt=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, ge=1, le=1024)
    repetition_penalty: float = Field(1.0, ge=1, le=3)
    repetition_scope: Literal["generated", "all"] = "generated"
    greedy: bool = False
    seed: int | None = Field(None, ge=0, le=2**31 - 1, strict=True)  # JSON false is not 0


class GenerateRequest(Sampling):
    images: list[str] = Field(
        min_length=1,
        max_length=MAX_SAMPLES,
        description="PNG, base64 (or raw:HxW:<base64 pixels>), one per prompt",
    )
    prompts: list[str] = Field(
        min_length=1, max_length=MAX_SAMPLES, description="Env prompts (chat template added)"
    )


class GenerationOut(BaseModel):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    value: float
    thought_mask: list[bool]
    action_mask: list[bool]
    entropy: list[float]
    has_action: bool
    finished: bool


class GenerateResponse(BaseModel):
    generations: list[GenerationOut]


class RolloutRequest(GenerateRequest):
    """``POST /rollout``: generate for each env's observation and step it, ``steps`` times.

    ``images``/``prompts`` are each session's current observation; later ones come from the env
    service this policy service is configured with (GTR_ENV_SERVICE_URL). With a ``seed``, step
    ``t`` samples with ``seed + t``."""

    sessions: list[str] = Field(
        min_length=1, max_length=MAX_SAMPLES, description="Env session ids, one per image"
    )
    steps: int = Field(ge=1, le=MAX_ROLLOUT_STEPS, description="Rollout steps to take")


class RolloutStepOut(BaseModel):
    """One line of ``POST /rollout``'s NDJSON stream: a rollout step of every session."""

    generations: list[GenerationOut]
    results: list[StepOut] = Field(description="Each session's env step, frames raw")
    generate_s: float = Field(description="Seconds the generation took")
    env_s: float = Field(description="Seconds the env service took, round trip included")


class RolloutError(BaseModel):
    """The stream's last line when a step failed: who failed, and the status it answered."""

    source: Literal["env", "policy"]
    status: int
    detail: str


class ScoreRequest(BaseModel):
    images: list[str] = Field(min_length=1, max_length=MAX_SAMPLES)
    prompts: list[str] = Field(min_length=1, max_length=MAX_SAMPLES)
    response_ids: list[list[int]] = Field(min_length=1, max_length=MAX_SAMPLES)
    temperature: float = Field(1.0, gt=0, le=5)


class ScoreResponse(BaseModel):
    logprobs: list[list[float]] = Field(description="(B, T), 0 on padding")
    entropy: list[list[float]]
    values: list[float]
    mask: list[list[int]] = Field(description="1 on real response tokens")


class CheckpointLoad(BaseModel):
    path: str = Field(min_length=1, max_length=1000, description="A folder written by Policy.save")


class Weights(BaseModel):
    """What the service serves (behind the token: paths are the deployment's own)."""

    model: str = Field(description="The base model's folder")
    checkpoint: str | None = Field(description="The loaded checkpoint, or None: base weights")


class Stats(BaseModel):
    batches: int = Field(description="generate() calls made on the model")
    requests: int
    samples: int
    largest_batch: int
    windows: int = Field(0, description="gathers that waited for more concurrent requests")
    checkpoint: str | None
    env_service: str | None = Field(None, description="The env service POST /rollout steps")
    env_pool: str | None = Field(
        None,
        description="The id of the env pool this service hosts under /env (GTR_POLICY_HOSTS_ENVS)"
        ", which POST /rollout steps in process",
    )


def encode_png(image: object) -> str:
    """Base64 PNG of an HxWx3 uint8 array or a PIL image."""
    pil = image if isinstance(image, Image.Image) else Image.fromarray(image)  # type: ignore[arg-type]
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def encode_frame(image: object, frames: str = "png") -> str:
    """``encode_png``, or raw pixels (``shared/frames.py``) when ``frames == "raw"``."""
    if frames != "raw":
        return encode_png(image)
    arr = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    return encode_raw(arr)


def decode_png(data: str, max_side: int) -> Image.Image:
    """PIL image from base64 PNG/JPEG, or raw pixels; ValueError with a message when bad or too
    large."""
    if len(data) > MAX_B64_CHARS:
        raise ValueError(f"image payload over {MAX_B64_CHARS} base64 characters")
    if is_raw(data):
        return Image.fromarray(decode_raw(data, max_side))
    try:
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
    except Exception as e:  # binascii and PIL raise several types for bad data
        raise ValueError(f"not a base64 PNG/JPEG image: {e}") from e
    if max(img.size) > max_side:
        raise ValueError(f"image {img.size[0]}x{img.size[1]} exceeds the {max_side}px limit")
    return img.convert("RGB")
