"""The REST API and web UI application."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.middleware import RateLimit, SecurityHeaders
from services.api.prom import api_registry
from services.api.routes import routers
from services.api.service import Conflict, Invalid, NotFound
from shared.allow import AllowEveryMethod
from shared.body_limit import BodyLimit
from shared.observe import install as install_metrics
from shared.service_auth import document_errors, validation_detail
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
    app.add_middleware(AllowEveryMethod, documented=app)
    app.add_middleware(
        RateLimit,
        per_minute=settings.api_rate_limit_per_minute,
        failures_per_minute=settings.auth_failures_per_minute,
    )
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(SecurityHeaders)
    _install_error_handlers(app)
    document_errors(app, API_ERRORS, open_paths=OPEN_API_PATHS)
    install_metrics(app, "api", api_registry())  # outermost: rate-limited requests count too
    return app


# Every status an /api operation may answer besides its own (documented in the OpenAPI file).
API_ERRORS = {
    400: "Malformed request (e.g. a blob id that is not a sha256)",
    401: "Missing, invalid or revoked API token",
    403: "The token's scope does not allow this, or a cross-origin cookie request",
    404: "Not found (or not visible to the token's team)",
    409: "Conflicts with the current state",
    413: "Request body too large",
    422: "Validation error",
    429: "Rate limit, or too many failed authentications from this address",
}
OPEN_API_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def _ui_bad_query(request: Request, detail: list[dict]) -> Response:
    from services.api.routes.ui import bad_query_page
    from shared.db.session import session_scope

    errors = [f"{'.'.join(e['loc'][1:] or e['loc'])}: {e['msg']}" for e in detail]
    with session_scope() as db:
        return bad_query_page(request, db, errors)


def _wants_html(request: Request) -> bool:
    """A browser asking for a page (its Accept names HTML), not an API client or a script."""
    accept = request.headers.get("accept", "")
    return (
        request.method in ("GET", "HEAD")
        and not request.url.path.startswith("/api")
        and "text/html" in accept
    )


def _ui_not_found(request: Request) -> Response:
    from services.api.auth import lookup_token, raw_token
    from services.api.routes.ui import render
    from shared.db.session import session_scope

    with session_scope() as db:
        token = lookup_token(db, raw_token(request))
        message = f"Nothing at {request.url.path[:200]}: no page has this address."
        return render(request, "error.html", token, 404, message=message, title="Not found")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # An address no route serves: a page for a browser, JSON for an API client.
        if exc.status_code == 404 and _wants_html(request):
            return await run_in_threadpool(_ui_not_found, request)
        return await http_exception_handler(request, exc)

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
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # Name each field and the reason; never echo the (possibly huge) input back.
        detail = validation_detail(exc)
        if request.method == "GET" and not request.url.path.startswith("/api"):
            return await run_in_threadpool(_ui_bad_query, request, detail)  # a page: HTML
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(StaleDataError)
    async def raced(_: Request, exc: StaleDataError) -> JSONResponse:
        # Another request changed or removed the row between our read and our write.
        return JSONResponse(
            {"detail": "changed or removed by another request meanwhile; reload and retry"},
            status_code=409,
        )

    @app.exception_handler(DataError)
    async def out_of_range(_: Request, exc: DataError) -> JSONResponse:
        # A value the schema allowed but the database cannot hold (e.g. an id past 2**31).
        # The documented 422 shape; the field is not known here.
        detail = [
            {"loc": [], "msg": "a value is out of the range the database accepts", "type": "range"}
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error; see the server log"}, status_code=500)
