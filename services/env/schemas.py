"""Wire types of the env service; images travel as base64 PNG, or raw pixels when the client
asks for them (header ``X-GTR-Frames: raw``, see ``shared/frames.py``)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.env.parser import ParsedOutput
from services.env.service import Observation, StepResult
from shared.frames import decode_raw, encode_raw
from shared.payload import check_free_form
from shared.schemas import EnvConfig, Task

FRAMES_HEADER = "X-GTR-Frames"  # "raw": observations carry image_raw instead of image_png_b64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def encode_png(image: np.ndarray) -> str:
    """uint8 H x W x 3 array -> base64 PNG."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_png(data: str) -> np.ndarray:
    """base64 PNG -> uint8 H x W x 3 array."""
    with Image.open(io.BytesIO(base64.b64decode(data))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


class CreateEnvRequest(_Strict):
    task: Task = Field(description="numberline | ezpoints | points24 | blackjack | alfworld")
    config: EnvConfig = Field(default_factory=lambda: EnvConfig.model_validate({}))
    seed: int | None = Field(  # strict: JSON false is not the seed 0
        None, ge=0, le=2**63 - 1, strict=True, description="Seeds the first episode; null = random"
    )


class StepRequest(_Strict):
    output: str | None = Field(None, max_length=100_000, description="The agent's raw output text")
    action: str | None = Field(
        None, max_length=1000, description="Or a legal action name (422 if illegal)"
    )

    @model_validator(mode="after")
    def _one_of(self) -> StepRequest:
        if (self.output is None) == (self.action is None):
            raise ValueError("give exactly one of 'output' and 'action'")
        return self


class BatchStepItem(StepRequest):
    id: str = Field(max_length=100, description="Session id")


class BatchStepRequest(_Strict):
    steps: list[BatchStepItem] = Field(max_length=4096)


class ResetRequest(_Strict):
    options: dict[str, Any] | None = Field(
        None, description='Fix the deal, e.g. {"cards": ["H4", "S3"]}'
    )

    @field_validator("options")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_free_form(value, "options")


class TargetFormulaRequest(_Strict):
    formula: str = Field(
        max_length=1000, description="The corrector's target formula, or NOT DETERMINED"
    )


class ObservationOut(BaseModel):
    image_png_b64: str | None = None
    image_raw: str | None = Field(None, description="raw:HxW:<base64 pixels>, when asked for")
    prompt: str
    state: dict[str, Any]
    display_png_b64: str | None = None  # the frame at display_size, for people; None = image

    @classmethod
    def of(cls, obs: Observation, raw: bool = False) -> ObservationOut:
        display = base64.b64encode(obs.display_png).decode("ascii") if obs.display_png else None
        if raw:
            return cls(
                image_raw=encode_raw(obs.image),
                prompt=obs.prompt,
                state=obs.state,
                display_png_b64=display,
            )
        return cls(
            image_png_b64=encode_png(obs.image),
            prompt=obs.prompt,
            state=obs.state,
            display_png_b64=display,
        )

    def to_observation(self) -> Observation:
        raw, png = self.image_raw, self.image_png_b64 or ""
        display = base64.b64decode(self.display_png_b64) if self.display_png_b64 else None
        return Observation(
            image=decode_raw(raw) if raw else decode_png(png),
            prompt=self.prompt,
            state=self.state,
            display_png=display,
        )


class ParsedOut(BaseModel):
    thought: str | None
    action_text: str | None
    action: int | None
    format_valid: bool
    action_valid: bool
    fields: dict[str, Any]


class StepOut(BaseModel):
    observation: ObservationOut
    reward: float
    terminated: bool
    truncated: bool
    done: bool
    parsed: ParsedOut
    action: str | None
    episode_return: float
    episode_length: int
    success: bool | None
    final_state: dict[str, Any] | None

    @classmethod
    def of(cls, r: StepResult, raw: bool = False) -> StepOut:
        return cls(
            observation=ObservationOut.of(r.observation, raw),
            reward=r.reward,
            terminated=r.terminated,
            truncated=r.truncated,
            done=r.done,
            parsed=ParsedOut(**vars(r.parsed)),
            action=r.action,
            episode_return=r.episode_return,
            episode_length=r.episode_length,
            success=r.success,
            final_state=r.final_state,
        )

    def to_result(self) -> StepResult:
        fields = self.model_dump(exclude={"observation", "parsed"})
        return StepResult(
            observation=self.observation.to_observation(),
            parsed=ParsedOutput(**self.parsed.model_dump()),
            **fields,
        )


class CreateEnvResponse(BaseModel):
    id: str
    task: str
    action_names: list[str]
    observation: ObservationOut


class BatchStepResponse(BaseModel):
    results: list[StepOut]


class SessionOut(BaseModel):
    id: str
    task: str
    seed: int | None
    config: dict[str, Any]
    episodes: int
    action_names: list[str]


def action_as_output(action: str) -> str:
    """A bare action name as an output the parser reads exactly."""
    return json.dumps({"action": action})
