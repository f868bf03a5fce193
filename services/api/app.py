"""The REST API and web UI application."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError

from services.api.middleware import BodyLimit, RateLimit, SecurityHeaders
from services.api.routes import routers
from services.api.service import Conflict, Invalid, NotFound
from shared.settings import Settings, get_settings
from shared.storage import BlobNotFound, InvalidBlobId

log = logging.getLogger("gtr.api")

MAX_BODY_BYTES = 8 * 1024 * 1024


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="gtr-lab",
        version="0.1.0",
        description="Train vision-language agents with Guided Thought Reinforcement.",
        docs_url=None,  # served by routes/ui.py from vendored assets (the CSP allows no CDN)
        redoc_url=None,
    )
    for router in routers():
        app.include_router(router)
    app.add_middleware(RateLimit, per_minute=settings.api_rate_limit_per_minute)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(SecurityHeaders)
    _install_error_handlers(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(NotFound)
    @app.exception_handler(BlobNotFound)
    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        detail = str(exc) if isinstance(exc, NotFound) else "blob not found"
        return JSONResponse({"detail": detail}, status_code=404)

    @app.exception_handler(Conflict)
    async def conflict(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(Invalid)
    async def invalid_value(_: Request, exc: Invalid) -> JSONResponse:
        detail = [{"loc": ["body", *exc.loc], "msg": exc.msg, "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(InvalidBlobId)
    async def bad_blob(_: Request, exc: InvalidBlobId) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Name each field and the reason; never echo the (possibly huge) input back.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(DataError)
    async def out_of_range(_: Request, exc: DataError) -> JSONResponse:
        # A value the schema allowed but the database cannot hold (e.g. an id past 2**31).
        return JSONResponse(
            {"detail": "a value is out of the range the database accepts"}, status_code=422
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error; see the server log"}, status_code=500)
