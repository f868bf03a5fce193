"""FastAPI app of the policy service: `create_app(policy)`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from services.env.app import ERRORS as ENV_ERRORS
from services.env.app import add_env_routes, pool_from
from services.env.client import EnvClient
from services.env.service import EnvPool
from services.policy.batching import Batcher
from services.policy.routes import router
from services.policy.schemas import MAX_REQUEST_BYTES
from shared.observe import install as install_metrics
from shared.service_auth import OPEN_PATHS, secure_service
from shared.settings import HOSTED_ENVS, Settings, get_settings

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
    """Serve `policy`: /generate (batched), /rollout (with the settings' env service, or the
    envs it hosts under /env), /score, /checkpoints/load, /healthz, /stats.

    Requests carry the settings' service token (when set); checkpoints load only from under
    the checkpoint store (GTR_CHECKPOINT_DIR) and GTR_CHECKPOINT_ROOTS."""
    settings = settings or get_settings()
    batcher = Batcher(policy, max_batch=max_batch, max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()
        if isinstance(app.state.envs, EnvClient):
            app.state.envs.shutdown()

    app = FastAPI(title="gtr policy", lifespan=lifespan)
    app.state.policy = policy
    app.state.batcher = batcher
    app.state.max_image_side = max_image_side
    app.state.max_response_tokens = max_response_tokens
    app.state.checkpoint = checkpoint
    app.state.checkpoint_roots = [settings.checkpoints_path, *settings.checkpoint_roots]
    app.state.envs = _rollout_envs(app, settings)
    app.include_router(router)
    install_metrics(app, "policy")
    errors = {
        404: "Checkpoint not found or not allowed",
        413: "Request body, prompt or response too large",
        422: "Validation error",
    }
    open_paths = OPEN_PATHS
    if isinstance(app.state.envs, EnvPool):
        errors = {**ENV_ERRORS, **errors, 404: f"{errors[404]}; {ENV_ERRORS[404].lower()}"}
        # The env routes' probe; their requests show in this service's own /metrics.
        open_paths = OPEN_PATHS | {f"{HOSTED_ENVS}/healthz"}
    return secure_service(
        app, settings.service_token_value, errors, open_paths, max_body_bytes=MAX_REQUEST_BYTES
    )


def _rollout_envs(app: FastAPI, settings: Settings) -> EnvPool | EnvClient | None:
    """What POST /rollout steps.

    Hosted (GTR_POLICY_HOSTS_ENVS): the env service's routes under /env over a pool in this
    process, which a rollout steps with no service hop: docs/benchmarks.md, "Envs in the policy
    service". Otherwise the env service at GTR_ENV_SERVICE_URL, with the token the others take;
    one client for every rollout: a new httpx client costs tens of ms (its TLS context), a
    rollout's first step paid that (docs/benchmarks.md, "One round trip a rollout step")."""
    if settings.policy_hosts_envs:
        pool = pool_from(settings)
        add_env_routes(app, pool, prefix=HOSTED_ENVS)
        return pool
    url = settings.env_service_url
    return EnvClient(url, token=settings.service_token_value) if url else None
