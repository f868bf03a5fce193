"""FastAPI app of the policy service: `create_app(policy)`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services.policy.batching import Batcher
from services.policy.routes import router
from shared.observe import install as install_metrics


def create_app(
    policy: Any,
    *,
    max_batch: int = 32,
    max_wait_ms: float = 5.0,
    max_image_side: int = 1024,
    max_response_tokens: int = 2048,
    checkpoint: str | None = None,
) -> FastAPI:
    """Serve `policy`: /generate (batched), /score, /checkpoints/load, /healthz, /stats."""
    batcher = Batcher(policy, max_batch=max_batch, max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="gtr policy", lifespan=lifespan)
    app.state.policy = policy
    app.state.batcher = batcher
    app.state.max_image_side = max_image_side
    app.state.max_response_tokens = max_response_tokens
    app.state.checkpoint = checkpoint
    app.include_router(router)
    install_metrics(app, "policy")
    return app
