"""`PolicyClient`: the policy service over HTTP, with `Policy.generate`'s signature."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from services.env.client import STATUS_ERRORS, EnvClient, EnvServiceError
from services.policy.protocol import ImageLike
from services.policy.rollout import RolloutStep
from services.policy.schemas import (
    MAX_SAMPLES,
    Generation,
    RolloutError,
    RolloutStepOut,
    ScoreResponse,
    encode_frame,
)
from shared.service_auth import auth_header, excerpt
from shared.settings import get_settings

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy


class PolicyServiceError(RuntimeError):
    """The policy service answered with an error status."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class PolicyClient:
    """Talks to `gtr policy serve`; returns the same `Generation` records as `Policy`.

    Frames go as raw pixels by default (``frames="png"`` sends PNG), which spares a PNG encode
    and decode per image; one keep-alive connection serves every call.
    `token`: the service token to send; None = the settings' GTR_SERVICE_TOKEN."""

    def __init__(
        self, base_url: str, timeout: float = 300.0, token: str | None = None, frames: str = "raw"
    ) -> None:
        token = token if token is not None else get_settings().service_token_value
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=auth_header(token)
        )
        self.frames = frames
        self.checkpoint: str | None = None  # the last one loaded, as the service names it

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = self._http.post(path, json=body)
        if r.status_code >= 400:
            raise PolicyServiceError(f"{path} -> {r.status_code}: {excerpt(r.text)}", r.status_code)
        return r.json()

    def generate(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        repetition_penalty: float = 1.0,
        repetition_scope: str = "generated",
        greedy: bool = False,
        seed: int | None = None,
    ) -> list[Generation]:
        """Same contract as `Policy.generate`. More than ``MAX_SAMPLES`` samples (a run's
        ``num_envs`` may be 256) go as concurrent requests of at most that many, which the
        service's batcher joins into model calls; a ``seed`` then seeds each request alike."""
        params = {
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "repetition_penalty": repetition_penalty,
            "repetition_scope": repetition_scope,
            "greedy": greedy,
            "seed": seed,
        }
        if len(images) != len(prompts):  # as `Policy.generate` raises it
            raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
        if len(images) <= MAX_SAMPLES:
            return self._generate(images, prompts, params)
        starts = range(0, len(images), MAX_SAMPLES)
        with ThreadPoolExecutor(len(starts), thread_name_prefix="generate") as pool:
            parts = pool.map(
                lambda i: self._generate(
                    images[i : i + MAX_SAMPLES], prompts[i : i + MAX_SAMPLES], params
                ),
                starts,
            )
            return [g for part in parts for g in part]

    def _generate(
        self, images: Sequence[ImageLike], prompts: Sequence[str], params: dict[str, Any]
    ) -> list[Generation]:
        body = {
            "images": [encode_frame(im, self.frames) for im in images],
            "prompts": list(prompts),
            **params,
        }
        return [Generation(**g) for g in self._post("/generate", body)["generations"]]

    def rollout(
        self,
        sessions: Sequence[str],
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        steps: int,
        params: dict[str, Any],
    ) -> Iterator[RolloutStep]:
        """``services.policy.rollout.roll`` run by the service against its env service (the same
        one as ours: see ``env_service``): each step as it is done. The errors are the ones
        ``EnvClient`` and ``generate`` raise; leaving the loop early stops the service's."""
        body = {
            "sessions": list(sessions),
            "images": [encode_frame(im, self.frames) for im in images],
            "prompts": list(prompts),
            "steps": steps,
            **params,
        }
        with self._http.stream("POST", "/rollout", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise PolicyServiceError(
                    f"/rollout -> {r.status_code}: {excerpt(r.text)}", r.status_code
                )
            done = 0
            for line in ndjson_lines(r.iter_bytes()):
                data = json.loads(line)
                if "source" in data:
                    raise _step_error(RolloutError.model_validate(data))
                out = RolloutStepOut.model_validate(data)
                done += 1
                yield RolloutStep(
                    [Generation(**g.model_dump()) for g in out.generations],
                    [s.to_result() for s in out.results],
                    out.generate_s,
                    out.env_s,
                )
        if done < steps:  # the service went away between two lines
            raise PolicyServiceError(f"/rollout ended after {done} of {steps} steps", 502)

    def steps_envs_of(self, envs: EnvClient) -> bool:
        """Whether the service's ``POST /rollout`` steps the sessions of ``envs``: it calls that
        env service, or it hosts that pool itself (GTR_POLICY_HOSTS_ENVS; the ids tell, not
        the URLs, which may name one host two ways)."""
        stats = self.stats()
        if stats.get("env_service") == envs.base_url:
            return True
        hosted = stats.get("env_pool")
        return hosted is not None and hosted == envs.pool_id()

    def score(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
    ) -> ScoreResponse:
        """Log-probs, entropies, values and mask as nested lists (no torch on the caller's side)."""
        body = {
            "images": [encode_frame(im, self.frames) for im in images],
            "prompts": list(prompts),
            "response_ids": [list(r) for r in response_ids],
            "temperature": temperature,
        }
        return ScoreResponse(**self._post("/score", body))

    def load_weights(self, path: str | Path) -> None:
        """Make the service load a checkpoint folder written by `Policy.save`."""
        self.checkpoint = self._post("/checkpoints/load", {"path": str(path)})["checkpoint"]

    def ensure_loaded(self) -> bool:
        """Load our checkpoint again if the service no longer serves it (restarted while we were
        not calling it, it serves its base weights); returns whether it had to."""
        if self.checkpoint is None or self.weights().get("checkpoint") == self.checkpoint:
            return False
        self.load_weights(self.checkpoint)
        return True

    def health(self) -> dict[str, Any]:
        r = self._http.get("/healthz", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def weights(self) -> dict[str, Any]:
        """The model and checkpoint the service serves (``GET /weights``)."""
        r = self._http.get("/weights", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def stats(self) -> dict[str, Any]:
        r = self._http.get("/stats")
        r.raise_for_status()
        return dict(r.json())


def ndjson_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of an NDJSON body, split on ``\n`` only. ``iter_lines`` splits as
    ``str.splitlines`` does, also on U+2028, U+0085 and others that JSON leaves unescaped in a
    string: a generated text holding one cut its line in two."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line)
    if buffer.strip():
        yield buffer


def _step_error(err: RolloutError) -> Exception:
    """The exception a rollout step's failure would have raised had we made the call ourselves."""
    message = f"{err.status}: {err.detail}"
    if err.source == "policy":
        return PolicyServiceError(f"/rollout -> {message}", err.status)
    if err.status in STATUS_ERRORS:
        return STATUS_ERRORS[err.status](message)
    return EnvServiceError(message, err.status)


if TYPE_CHECKING:  # mypy holds the class to the contract the controller codes against
    _contract: type[RolloutPolicy] = PolicyClient
