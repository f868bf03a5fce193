"""FastAPI app of the policy service: `create_app(policy)`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from services.env.client import EnvClient
from services.policy.batching import Batcher
from services.policy.routes import router
from shared.observe import install as install_metrics
from shared.service_auth import secure_service
from shared.settings import Settings, get_settings

if TYPE_CHECKING:
    from services.policy.service import Policy
    from services.policy.vllm_backend import VllmPolicy


def create_app(
    policy: Policy | VllmPolicy,
    *,
    max_batch: int = 32,
    max_wait_ms: float = 5.0,
    max_image_side: int = 1024,
    max_response_tokens: int = 2048,
    checkpoint: str | None = None,
    settings: Settings | None = None,
) -> FastAPI:
    """Serve `policy`: /generate (batched), /rollout (with the settings' env service), /score,
    /checkpoints/load, /healthz, /stats.

    Requests carry the settings' service token (when set); checkpoints load only from under
    the checkpoint store (GTR_CHECKPOINT_DIR) and GTR_CHECKPOINT_ROOTS."""
    settings = settings or get_settings()
    batcher = Batcher(policy, max_batch=max_batch, max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()
        if app.state.envs is not None:
            app.state.envs.shutdown()

    app = FastAPI(title="gtr policy", lifespan=lifespan)
    app.state.policy = policy
    app.state.batcher = batcher
    app.state.max_image_side = max_image_side
    app.state.max_response_tokens = max_response_tokens
    app.state.checkpoint = checkpoint
    app.state.checkpoint_roots = [settings.checkpoints_path, *settings.checkpoint_roots]
    # POST /rollout steps envs through this env service, with the token the others take. One
    # client for every rollout: a new httpx client costs tens of ms (its TLS context), a
    # rollout's first step paid that (docs/benchmarks.md, "One round trip a rollout step").
    url = settings.env_service_url
    app.state.envs = EnvClient(url, token=settings.service_token_value) if url else None
    app.include_router(router)
    install_metrics(app, "policy")
    errors = {
        404: "Checkpoint not found or not allowed",
        413: "Request body, prompt or response too large",
        422: "Validation error",
    }
    return secure_service(app, settings.service_token_value, errors)
