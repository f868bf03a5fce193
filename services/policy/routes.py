"""HTTP routes of the policy service: thin adapters over `Policy` and the `Batcher`."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from PIL import Image

from services.policy.schemas import (
    MAX_PROMPT_CHARS,
    CheckpointLoad,
    GenerateRequest,
    GenerateResponse,
    GenerationOut,
    ScoreRequest,
    ScoreResponse,
    Stats,
    decode_png,
)
from services.policy.vllm_backend import served_for_checkpoint
from shared.paths import CHECKPOINT_NOT_FOUND, confined
from shared.responses import model_response

router = APIRouter()


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
def healthz(request: Request) -> dict[str, Any]:
    """Liveness, and which model and checkpoint are loaded."""
    policy = request.app.state.policy
    return {"ok": True, "model": str(policy.model_path), "checkpoint": request.app.state.checkpoint}


@router.get("/stats", response_model=Stats)
def stats(request: Request) -> Stats:
    """Batching counters: model calls, requests, samples, largest batch."""
    s = request.app.state.batcher.stats
    return Stats(
        batches=s.batches,
        requests=s.requests,
        samples=s.samples,
        largest_batch=s.largest_batch,
        windows=s.windows,
        checkpoint=request.app.state.checkpoint,
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
