"""The env service: FastAPI over an ``EnvPool`` (``gtr env serve``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.env.routes import router
from services.env.service import EnvError, EnvPool, EpisodeNotStarted, PoolFull, SessionNotFound
from shared.observe import install as install_metrics

_STATUS: dict[type[Exception], int] = {
    SessionNotFound: 404,
    EpisodeNotStarted: 409,
    EnvError: 422,
    PoolFull: 429,
}


def create_app(pool: EnvPool | None = None) -> FastAPI:
    """The app; pass a pool to share it (tests, embedded mode)."""
    app = FastAPI(title="gtr-lab env service", version="0.1.0")
    app.state.pool = pool if pool is not None else EnvPool()
    app.include_router(router)
    install_metrics(app, "env")
    for exc, status in _STATUS.items():
        app.add_exception_handler(exc, _handler(status))
    return app


def _handler(status: int):  # noqa: ANN202 - a FastAPI exception handler
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        detail = f"unknown session {exc.args[0]}" if isinstance(exc, SessionNotFound) else str(exc)
        return JSONResponse(status_code=status, content={"detail": detail})

    return handle
