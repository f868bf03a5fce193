"""Response types of the REST API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class _Orm(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class CorrectorCost(BaseModel):
    calls: int  # requests sent to the corrector's endpoint, retries included
    tokens: int  # tokens the endpoint billed
    seconds: float  # summed latency of the finished corrections (a local corrector's cost)


class RunOut(_Orm):
    id: int
    name: str
    team: str
    task: str
    algorithm: str
    status: str
    error: str | None
    env_steps: int
    total_env_steps: int
    num_updates: int
    updates_done: int
    alarm: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    config: dict[str, Any]
    info: dict[str, Any] = {}
    latest_metrics: dict[str, Any] = {}
    cancel_requested: bool = False
    phase: str | None = None
    phase_step: int | None = None
    phase_total: int | None = None
    phase_at: datetime | None = None
    elapsed_s: float | None = None  # seconds of work: time spent stopped before a resume is not
    eta_s: float | None = None  # at the current phase's own rate
    eta_of: Literal["warm start", "run"] | None = None  # what eta_s is the time left of
    # Seconds the phase under way has run past its measured time: above 0, eta_s is a floor.
    eta_over_s: float = 0.0
    corrector_cost: CorrectorCost | None = None  # None: the run sends no step to a corrector


class UpdateOut(_Orm):
    idx: int
    metrics: dict[str, Any]
    alarm: bool
    created_at: datetime


class EpisodeOut(_Orm):
    id: int
    run_id: int
    env_index: int
    seq: int
    update_idx: int
    length: int
    total_return: float
    success: bool | None
    finished: bool
    corrected_steps: int
    meta: dict[str, Any]


class CorrectionOut(_Orm):
    id: int
    step_id: int
    corrector: str
    status: str
    verdict: str | None
    corrected_thought: str | None
    extras: dict[str, Any]
    reasoning: str | None
    raw: str | None = None  # the corrector's answer as it came, for audits of failures
    error: str | None
    latency_ms: float | None
    tokens: int
    attempts: int


class StepOut(_Orm):
    id: int
    run_id: int
    episode_id: int
    idx: int
    update_idx: int
    prompt: str
    output: str
    thought: str | None
    action_text: str | None
    parsed_action: str | None
    format_valid: bool
    action_valid: bool
    reward: float
    done: bool
    value: float | None
    logprob: float | None
    image_sha: str | None
    display_sha: str | None = None  # the frame for people (blob), once drawn: see display_url
    display_url: str = ""  # the frame for people (PNG), drawn from `state` on first view
    state: dict[str, Any]
    corrections: list[CorrectionOut] = []


class StepDetail(StepOut):
    prev_step_id: int | None = None
    next_step_id: int | None = None
    prev_episode_id: int | None = None
    next_episode_id: int | None = None


class CheckpointOut(_Orm):
    id: int
    update_idx: int
    path: str
    size_bytes: int
    sha256: str
    created_at: datetime


class TokenOut(_Orm):
    name: str
    scope: str
    team: str
