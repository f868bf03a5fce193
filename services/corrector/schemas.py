"""Wire types of the corrector: the `/v1/correct` protocol and the registry API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from shared.schemas import TASKS, Correction, CorrectionRequest, Task

__all__ = [
    "TASKS",
    "Correction",
    "CorrectionRequest",
    "CorrectorCreate",
    "CorrectorOut",
    "CorrectorPatch",
    "CorrectorStats",
    "CorrectorTest",
    "CorrectorTestResult",
]

Kind = Literal["openai", "http", "oracle"]
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
ENV_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"


class CorrectorCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=100,
        pattern=NAME_RE,
        description="Unique name a run config refers to",
    )
    kind: Kind = Field(description="openai = chat completions; http = a POST /v1/correct service")
    base_url: str | None = Field(default=None, max_length=500, description="http(s) URL")
    model: str | None = Field(default=None, max_length=200, description="Model (kind openai)")
    params: dict[str, Any] = Field(
        default_factory=dict, description="RemoteParams: timeout_s, concurrency ..."
    )
    api_key: SecretStr | None = Field(default=None, description="Stored encrypted, never returned")
    api_key_env: str | None = Field(
        default=None,
        max_length=100,
        pattern=ENV_RE,
        description="Or: the environment variable that holds the key",
    )


class CorrectorPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(default=None, max_length=500)
    model: str | None = Field(default=None, max_length=200)
    params: dict[str, Any] | None = None
    api_key: SecretStr | None = Field(default=None, description="A new key; '' removes it")
    api_key_env: str | None = Field(
        default=None, max_length=100, pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$"
    )


class CorrectorOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    kind: str
    base_url: str | None
    model: str | None
    params: dict[str, Any]
    api_key_set: bool = Field(
        description="Whether an encrypted key is stored (the key is never returned)"
    )
    api_key_env: str | None
    team: str
    created_at: datetime


class CorrectorTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: Task = Field(default="numberline", description="Task whose rendered state is sent")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed of the sample state")


class CorrectorTestResult(BaseModel):
    ok: bool
    verdict: str | None = None
    corrected_thought: str | None = None
    latency_ms: float
    tokens: int = 0
    error: str | None = None
    raw: str | None = Field(default=None, description="The model's answer as it came")
    attempts: int = Field(default=0, description="HTTP requests the test made")


class CorrectorStats(BaseModel):
    corrector: str
    total: int
    done: int
    failed: int
    pending: int
    failure_rate: float | None = Field(description="failed / (done + failed)")
    incorrect_rate: float | None = Field(
        description="Share of done corrections with verdict incorrect"
    )
    latency_mean_ms: float | None
    latency_p95_ms: float | None
    tokens: int
