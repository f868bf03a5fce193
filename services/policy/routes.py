"""HTTP routes of the policy service: thin adapters over `Policy` and the `Batcher`."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from PIL import Image

from services.env.client import STATUS_ERRORS, EnvClient, EnvServiceError
from services.env.schemas import StepOut
from services.env.service import EnvPool
from services.policy.batching import BatchedPolicy
from services.policy.rollout import RolloutStep, roll
from services.policy.schemas import (
    MAX_PROMPT_CHARS,
    CheckpointLoad,
    GenerateRequest,
    GenerateResponse,
    GenerationOut,
    RolloutError,
    RolloutRequest,
    RolloutStepOut,
    ScoreRequest,
    ScoreResponse,
    Stats,
    Weights,
    decode_png,
)
from services.policy.vllm_backend import served_for_checkpoint
from shared.paths import CHECKPOINT_NOT_FOUND, confined
from shared.responses import model_response
from shared.service_auth import excerpt

router = APIRouter()
log = logging.getLogger("gtr.policy")


def _images(state: Any, images: list[str], prompts: list[str]) -> list[Image.Image]:
    if len(images) != len(prompts):
        raise HTTPException(422, f"{len(images)} images for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if len(p) > MAX_PROMPT_CHARS:
            raise HTTPException(
                413, f"prompt {i} has {len(p)} characters; the limit is {MAX_PROMPT_CHARS}"
            )
    try:
        return [decode_png(b, state.max_image_side) for b in images]
    except ValueError as e:
        raise HTTPException(422, str(e)) from e


@router.get("/healthz")
def healthz() -> dict[str, Any]:
    """Liveness (open to probes: nothing about the deployment's paths)."""
    return {"ok": True}


@router.get("/weights", response_model=Weights)
def weights(request: Request) -> Weights:
    """Which model and checkpoint are loaded."""
    policy = request.app.state.policy
    return Weights(model=str(policy.model_path), checkpoint=request.app.state.checkpoint)


@router.get("/stats", response_model=Stats)
def stats(request: Request) -> Stats:
    """Batching counters: model calls, requests, samples, largest batch."""
    s, envs = request.app.state.batcher.stats, request.app.state.envs
    return Stats(
        batches=s.batches,
        requests=s.requests,
        samples=s.samples,
        largest_batch=s.largest_batch,
        windows=s.windows,
        checkpoint=request.app.state.checkpoint,
        env_service=envs.base_url if isinstance(envs, EnvClient) else None,
        env_pool=envs.pool_id if isinstance(envs, EnvPool) else None,
    )


@router.post("/generate", response_model=GenerateResponse)
async def generate(req: GenerateRequest, request: Request) -> Response:
    """Sample one response per (image, prompt); concurrent requests are batched together."""
    batcher = request.app.state.batcher
    async with batcher.incoming():
        images = await asyncio.to_thread(_images, request.app.state, req.images, req.prompts)
    params = req.model_dump(exclude={"images", "prompts"})
    try:
        gens = await batcher.submit(images, req.prompts, params)
    except ValueError as e:
        raise HTTPException(422, str(e)) from e
    # Built from the records' attributes (`dataclasses.asdict` deep-copies every list) and sent
    # as it is (shared/responses.py).
    out = [GenerationOut.model_validate(g, from_attributes=True) for g in gens]
    return model_response(GenerateResponse(generations=out))


@router.post(
    "/rollout",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "NDJSON: a RolloutStepOut line per step as it is done; a "
            "RolloutError line last when a step failed",
            "content": {"application/x-ndjson": {}},
        },
        409: {
            "description": "This policy service steps no envs (GTR_ENV_SERVICE_URL unset, "
            "GTR_POLICY_HOSTS_ENVS false)"
        },
    },
)
async def rollout(req: RolloutRequest, request: Request) -> StreamingResponse:
    """Roll env sessions ``steps`` steps: generate for each session's observation (batched with
    every other request), step the sessions through the env service (or in this process, where
    it hosts them), again with the observations that came back. A controller spares one round
    trip a rollout step this way."""
    state = request.app.state
    if state.envs is None:
        raise HTTPException(
            409,
            "this policy service steps no envs: start it with GTR_ENV_SERVICE_URL set "
            "or GTR_POLICY_HOSTS_ENVS=true",
        )
    if len(req.sessions) != len(req.prompts):
        raise HTTPException(422, f"{len(req.sessions)} sessions for {len(req.prompts)} prompts")
    async with state.batcher.incoming():
        images = await asyncio.to_thread(_images, state, req.images, req.prompts)
    params = req.model_dump(exclude={"images", "prompts", "sessions", "steps"})
    lines = _rollout_lines(state, req, images, params)
    return StreamingResponse(lines, media_type="application/x-ndjson")


async def _rollout_lines(
    state: Any, req: RolloutRequest, images: list[Image.Image], params: dict[str, Any]
) -> AsyncIterator[str]:
    """Drives ``roll`` on a thread of its own (its env calls block) and sends each step as it
    comes; the thread stops after the step it is in when the client goes away."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    stop = threading.Event()

    def put(line: str | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, line)

    def drive() -> None:
        try:
            policy = BatchedPolicy(state.batcher, loop)
            steps = roll(policy, state.envs, req.sessions, images, req.prompts, req.steps, params)
            for step in steps:  # the next step generates while this one is serialised
                put(_step_line(step))
                if stop.is_set():
                    return
        except Exception as e:  # the stream's last line says what failed; never a traceback
            where = getattr(state.envs, "base_url", "this process")
            put(_rollout_error(e, where).model_dump_json() + "\n")
        finally:
            put(None)

    threading.Thread(target=drive, name="rollout", daemon=True).start()
    try:
        while (line := await queue.get()) is not None:
            yield line
    finally:
        stop.set()


def _step_line(step: RolloutStep) -> str:
    gens = step.generations
    return (
        RolloutStepOut(
            generations=[GenerationOut.model_validate(g, from_attributes=True) for g in gens],
            results=[StepOut.of(r, raw=True) for r in step.results],
            generate_s=step.generate_s,
            env_s=step.env_s,
        ).model_dump_json()
        + "\n"
    )


def _rollout_error(e: Exception, env_url: str) -> RolloutError:
    """Who failed a rollout step, with the status its own route would have answered."""
    if isinstance(e, httpx.TransportError):
        return RolloutError(
            source="env", status=503, detail=f"the env service at {env_url} does not answer: {e}"
        )
    if isinstance(e, EnvServiceError):
        return RolloutError(source="env", status=e.status_code, detail=excerpt(str(e)))
    for status, kind in STATUS_ERRORS.items():
        if isinstance(e, kind):
            return RolloutError(source="env", status=status, detail=excerpt(str(e)))
    if isinstance(e, ValueError):  # the sampling settings (as POST /generate answers them)
        return RolloutError(source="policy", status=422, detail=excerpt(str(e)))
    log.exception("a rollout step failed")
    detail = f"{type(e).__name__}: generation failed"
    return RolloutError(source="policy", status=500, detail=detail)


@router.post("/score", response_model=ScoreResponse)
async def score(req: ScoreRequest, request: Request) -> Response:
    """Per-token log-probs, entropies and values of given responses."""
    policy = request.app.state.policy
    images = await asyncio.to_thread(_images, request.app.state, req.images, req.prompts)
    vocab = len(policy.tokenizer)
    if len(req.response_ids) != len(req.prompts):
        raise HTTPException(
            422, f"{len(req.response_ids)} responses for {len(req.prompts)} prompts"
        )
    if any(not 0 <= t < vocab for r in req.response_ids for t in r):
        raise HTTPException(422, f"response_ids must lie in [0, {vocab})")
    if any(len(r) > request.app.state.max_response_tokens for r in req.response_ids):
        raise HTTPException(
            413, f"a response is longer than {request.app.state.max_response_tokens} tokens"
        )
    out = await asyncio.to_thread(
        policy.score, images, req.prompts, req.response_ids, temperature=req.temperature
    )
    return model_response(
        ScoreResponse(
            logprobs=out.logprobs.tolist(),
            entropy=out.entropy.tolist(),
            values=out.values.tolist(),
            mask=out.mask.long().tolist(),
        )
    )


@router.post("/checkpoints/load")
async def load_checkpoint(body: CheckpointLoad, request: Request) -> dict[str, Any]:
    """Load a checkpoint folder (written by Policy.save) into the served policy: a path relative
    to the checkpoint store (its id there) or an absolute one under an allowed root."""
    path = confined(body.path, request.app.state.checkpoint_roots, "policy.json")
    if path is None:
        # One answer for "absent" and "not allowed": the reply must not map the file system.
        raise HTTPException(404, CHECKPOINT_NOT_FOUND)
    try:
        # A run may bring another base model or fine-tuning mode: then the policy is rebuilt.
        policy = await asyncio.to_thread(served_for_checkpoint, request.app.state.policy, path)
        request.app.state.policy = request.app.state.batcher.policy = policy
    except (ValueError, OSError) as e:
        raise HTTPException(422, f"cannot load the checkpoint: {e}") from e
    request.app.state.checkpoint = str(path)
    return {"ok": True, "checkpoint": str(path)}
