"""The env service: FastAPI over an ``EnvPool`` (``gtr env serve``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.env.routes import router
from services.env.service import EnvError, EnvPool, EpisodeNotStarted, PoolFull, SessionNotFound
from shared.observe import install as install_metrics
from shared.service_auth import excerpt, secure_service
from shared.settings import Settings, get_settings

_STATUS: dict[type[Exception], int] = {
    SessionNotFound: 404,
    EpisodeNotStarted: 409,
    EnvError: 422,
    PoolFull: 429,
}


# What each error status means, for the OpenAPI document of any app that serves these routes.
ERRORS = {
    404: "Unknown or expired session",
    409: "Episode not started",
    413: "Request body too large",
    422: "Validation error",
    429: "The pool is full",
}


def create_app(pool: EnvPool | None = None, settings: Settings | None = None) -> FastAPI:
    """The app; pass a pool to share it (tests, embedded mode). Requests carry the settings'
    service token, when one is set."""
    settings = settings or get_settings()
    app = FastAPI(title="gtr-lab env service", version="0.1.0")
    add_env_routes(app, pool if pool is not None else pool_from(settings))
    install_metrics(app, "env")
    return secure_service(app, settings.service_token_value, ERRORS)


def add_env_routes(app: FastAPI, pool: EnvPool, prefix: str = "") -> None:
    """The env service's routes over ``pool`` on ``app``, under ``prefix``: the env service's
    own app, or a policy service that hosts envs (``shared.settings.HOSTED_ENVS``)."""
    app.state.pool = pool
    app.include_router(router, prefix=prefix)
    for exc, status in _STATUS.items():
        app.add_exception_handler(exc, _handler(status))


def pool_from(settings: Settings) -> EnvPool:
    """A pool bounded as the settings say: session count, image size, idle time and where
    ALFWorld games may lie."""
    return EnvPool(
        max_sessions=settings.env_max_sessions,
        ttl_s=settings.env_session_ttl_s,
        max_image_size=settings.env_max_image_size,
        games_roots=settings.games_paths,
    )


def _handler(status: int):  # noqa: ANN202 - a FastAPI exception handler
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=status, content={"detail": excerpt(str(exc))})

    return handle
