"""Wire types of the corrector: the `/v1/correct` protocol and the registry API."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from shared.payload import check_free_form
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
# Keys come from the encrypted store, or from variables under this one prefix only: a
# corrector must not be able to send GTR_DATABASE_URL (or any other setting) as its key.
KEY_ENV_PREFIX = "GTR_CORRECTOR_KEY_"
ENV_RE = r"^GTR_CORRECTOR_KEY_[A-Z0-9_]{1,80}$"
# An HTTP header value: printable ASCII without spaces (a key outside it cannot be sent).
_KEY_RE = r"^[\x21-\x7e]{1,4096}$"


def _check_key(value: SecretStr | None, allow_empty: bool) -> SecretStr | None:
    raw = value.get_secret_value() if value is not None else ""
    if raw == "" and (allow_empty or value is None):
        return value
    if not re.fullmatch(_KEY_RE, raw):
        raise ValueError(
            "api_key must be 1 to 4096 printable ASCII characters without spaces "
            "(it is sent as an HTTP header)"
        )
    return value


class CorrectorCreate(BaseModel):
    # strict: a JSON 0 is no boolean, "1" no number (schemathesis --checks all)
    model_config = ConfigDict(extra="forbid", strict=True)

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
        description="Or: the environment variable that holds the key (GTR_CORRECTOR_KEY_*)",
    )
    shared: bool = Field(
        default=False, description="Usable by every team's runs; otherwise only by its team's"
    )

    @field_validator("params")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_free_form(value, "params")

    @field_validator("api_key")
    @classmethod
    def _ascii_key(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_key(value, allow_empty=True)


class CorrectorPatch(BaseModel):
    # strict: a JSON 0 is no boolean, "1" no number (schemathesis --checks all)
    model_config = ConfigDict(extra="forbid", strict=True)

    base_url: str | None = Field(default=None, max_length=500)
    model: str | None = Field(default=None, max_length=200)
    params: dict[str, Any] | None = None
    api_key: SecretStr | None = Field(default=None, description="A new key; '' removes it")
    api_key_env: str | None = Field(
        default=None,
        max_length=100,
        pattern=r"^(GTR_CORRECTOR_KEY_[A-Z0-9_]{1,80})?$",
        description="GTR_CORRECTOR_KEY_*; '' removes it",
    )
    shared: bool | None = Field(default=None, description="Usable by every team's runs")

    @field_validator("params")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_free_form(value, "params")

    @field_validator("api_key")
    @classmethod
    def _ascii_key(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_key(value, allow_empty=True)


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
    shared: bool = Field(default=False, description="Usable by every team's runs")
    created_at: datetime


class CorrectorTest(BaseModel):
    # strict: a JSON 0 is no boolean, "1" no number (schemathesis --checks all)
    model_config = ConfigDict(extra="forbid", strict=True)

    task: Task = Field(default="numberline", description="Task whose rendered state is sent")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed of the sample state")
    probe: bool = Field(
        default=True,
        description="Kind openai: first ask for a trivial JSON schema at each structured-output "
        "level (up to 3 more requests) to find out what the endpoint enforces, as "
        "`gtr corrector test` does",
    )


class ProbeStep(BaseModel):
    level: str = Field(description="json_schema, json_object_schema or json_object")
    outcome: Literal["enforced", "ignored", "refused", "failed"]
    reason: str | None = Field(
        default=None,
        description="Why the answer shows the level ignored (e.g. 'malformed: answer is not "
        "JSON'), or the error's category when refused or failed; never the remote's words",
    )


class CorrectorTestResult(BaseModel):
    ok: bool
    verdict: str | None = None
    corrected_thought: str | None = None
    latency_ms: float
    tokens: int = 0
    error: str | None = None
    raw: str | None = Field(default=None, description="The model's answer as it came")
    attempts: int = Field(default=0, description="HTTP requests the test made")
    structured: str | None = Field(
        default=None,
        description="What the endpoint did with structured output (kind openai): enforced, "
        "ignored or refused at each level tried, and what the corrector does about it",
    )
    probe: list[ProbeStep] = Field(
        default_factory=list, description="Each structured-output level probed, in order"
    )


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
