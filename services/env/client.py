"""``EnvClient``: the env service over HTTP with ``EnvPool``'s methods, dataclasses and errors,
so the controller can use either one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from services.env.schemas import (
    FRAMES_HEADER,
    BatchStepResponse,
    CreateEnvResponse,
    ObservationOut,
    StepOut,
)
from services.env.service import (
    EnvError,
    EpisodeNotStarted,
    Observation,
    PoolFull,
    SessionNotFound,
    StepResult,
)
from shared.schemas import EnvConfig
from shared.service_auth import auth_header
from shared.settings import get_settings


class EnvServiceError(RuntimeError):
    """The env service answered with another error status (a 5xx: a crash or a restart)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


# The env service's error statuses and the exceptions EnvPool raises for them.
STATUS_ERRORS: dict[int, type[Exception]] = {
    404: SessionNotFound,
    409: EpisodeNotStarted,
    422: EnvError,
    429: PoolFull,
}


class EnvClient:
    """HTTP client of the env service (``POST /envs`` ... ``DELETE /envs/{id}``).

    Frames come as raw pixels by default (``frames="png"`` asks for PNG), which spares a PNG
    encode and decode per observation; one keep-alive connection serves every call."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        frames: str = "raw",
    ):
        """`token`: the service token to send; None = the settings' GTR_SERVICE_TOKEN."""
        token = token if token is not None else get_settings().service_token_value
        headers = {**auth_header(token), **({FRAMES_HEADER: "raw"} if frames == "raw" else {})}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport, headers=headers
        )
        # The service starts each session's first episode at creation; reset() hands it over,
        # so create + reset here replays exactly what it does on an EnvPool.
        self._first: dict[str, Observation] = {}

    @property
    def base_url(self) -> str:
        """The service's URL, as given (no trailing slash)."""
        return str(self._http.base_url).rstrip("/")

    def __enter__(self) -> EnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def _call(self, method: str, path: str, json: Any = None) -> Any:
        resp = self._http.request(method, path, json=json)
        if resp.status_code >= 400:
            detail = resp.reason_phrase
            if resp.content:
                try:
                    detail = resp.json().get("detail", resp.text)
                except ValueError:  # a proxy's or a dying server's page, not our JSON
                    detail = resp.text[:500]
            message = f"{resp.status_code}: {detail}"
            if resp.status_code in STATUS_ERRORS:
                raise STATUS_ERRORS[resp.status_code](message)
            raise EnvServiceError(message, resp.status_code)
        return resp.json() if resp.content else None

    def health(self) -> None:
        """Raises unless the service answers ``GET /healthz``."""
        self._http.get("/healthz", timeout=5).raise_for_status()

    def pool_id(self) -> str | None:
        """The id of the service's pool (``GET /healthz``); None from a service without one."""
        return self._call("GET", "/healthz").get("pool")  # type: ignore[no-any-return]

    def create(
        self, task: str, config: EnvConfig | dict[str, Any] | None = None, seed: int | None = None
    ) -> str:
        """Open a session; returns its id."""
        cfg = config.model_dump() if isinstance(config, EnvConfig) else (config or {})
        data = CreateEnvResponse.model_validate(
            self._call("POST", "/envs", {"task": task, "config": cfg, "seed": seed})
        )
        self._first[data.id] = data.observation.to_observation()
        return data.id

    def reset(self, session_id: str, options: dict[str, Any] | None = None) -> Observation:
        """Start a new episode (the first call returns the one begun at creation)."""
        first = self._first.pop(session_id, None)
        if first is not None and options is None:
            return first
        data = self._call("POST", f"/envs/{session_id}/reset", {"options": options})
        return ObservationOut.model_validate(data).to_observation()

    def step(self, session_id: str, output_text: str) -> StepResult:
        """Step with the agent's output."""
        self._first.pop(session_id, None)
        data = self._call("POST", f"/envs/{session_id}/step", {"output": output_text})
        return StepOut.model_validate(data).to_result()

    def step_batch(self, items: Sequence[tuple[str, str]]) -> list[StepResult]:
        """Step many sessions in one request."""
        for sid, _ in items:
            self._first.pop(sid, None)
        body = {"steps": [{"id": sid, "output": text} for sid, text in items]}
        data = BatchStepResponse.model_validate(self._call("POST", "/envs/step", body))
        return [r.to_result() for r in data.results]

    def close(self, session_id: str) -> None:
        """Close a session."""
        self._first.pop(session_id, None)
        self._call("DELETE", f"/envs/{session_id}")

    def describe(self, session_id: str) -> dict[str, Any]:
        """Task, seed, config, episodes and current action names of a session."""
        data = self._call("GET", f"/envs/{session_id}")
        data.pop("id", None)
        return data

    def set_target_formula(self, session_id: str, formula: str) -> None:
        """Points games: remember the corrector's target formula for this episode."""
        self._call("PUT", f"/envs/{session_id}/target_formula", {"formula": formula})
