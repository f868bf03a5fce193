"""What every internal service (env, policy, corrector) shares with the API at its door:
a bearer service token, the API's body limit, short error bodies that never echo the input,
and documented error responses in its OpenAPI document.

Only the controller and the workers hold the token (GTR_SERVICE_TOKEN); `/healthz` stays open
for the orchestrator's probes.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("gtr.service")

MAX_BODY_BYTES = 8 * 1024 * 1024  # the API's limit, and every internal service's but the policy's
MAX_DETAIL_CHARS = 300  # an error text longer than this is cut: never an echo of the input
# /metrics (counts and latencies, no run data) stays open so Prometheus needs no service token.
OPEN_PATHS = frozenset({"/healthz", "/metrics"})


def excerpt(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """At most `limit` characters of `text`, marked when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def auth_header(token: str | None) -> dict[str, str]:
    """The header a client of an internal service sends (none when no token is configured)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class ServiceToken:
    """ASGI middleware: 401 for a request without the right bearer token (constant-time)."""

    def __init__(
        self, app: ASGIApp, token: str | None, open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.expected = token.encode() if token else None
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value
        given = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(given, self.expected):
            response = JSONResponse(
                {"detail": "missing or wrong service token (GTR_SERVICE_TOKEN)"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def validation_detail(exc: RequestValidationError) -> list[dict[str, Any]]:
    """Each field and the reason, never the (possibly huge) input: the one 422 shape."""
    return [
        {
            "loc": [str(x) for x in e.get("loc", ())],
            "msg": excerpt(str(e.get("msg", ""))),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]


def install_error_handlers(app: FastAPI) -> None:
    """422 without echo, other HTTP errors cut to an excerpt, and no traceback on a crash."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_detail(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        if isinstance(detail, str):
            detail = excerpt(detail)
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error; see the server log"}, status_code=500)


def secure_service(
    app: FastAPI,
    token: str | None,
    errors: dict[int, str],
    open_paths: frozenset[str] = OPEN_PATHS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """Token, body limit, error handlers and documented errors for an internal service app;
    ``open_paths`` take no token (probes and scrapes)."""
    from shared.allow import AllowEveryMethod
    from shared.body_limit import BodyLimit

    app.add_middleware(AllowEveryMethod, documented=app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # outermost: no body is read without it
    app.add_middleware(ServiceToken, token=token, open_paths=open_paths)
    install_error_handlers(app)
    common = {400: "Malformed request body", 401: "Missing or wrong service token"}
    document_errors(app, {**common, **errors}, open_paths=open_paths)
    return app


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["loc", "msg", "type"],
                        "properties": {
                            "loc": {"type": "array", "items": {"type": "string"}},
                            "msg": {"type": "string"},
                            "type": {"type": "string"},
                        },
                    },
                },
                {"type": "object"},
            ]
        }
    },
}


def document_errors(
    app: FastAPI, errors: dict[int, str], open_paths: frozenset[str] = frozenset()
) -> None:
    """Adds `errors` (status -> description) with the one error schema to every operation of
    the app's OpenAPI document, and replaces FastAPI's 422 schema by ours (detail items carry
    loc, msg and type only)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        body = {"application/json": {"schema": ERROR_SCHEMA}}
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                for status, text in errors.items():
                    if status == 401 and path in open_paths:
                        continue
                    op["responses"].setdefault(str(status), {"description": text, "content": body})
                if "422" in op["responses"]:
                    op["responses"]["422"] = {"description": "Validation error", "content": body}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def serve_settings() -> Any:
    """The settings for a `serve` command, or a click error naming what production lacks
    (the same check `gtr serve` makes, so no service starts with default secrets)."""
    import click
    from pydantic import ValidationError

    from shared.settings import get_settings, settings_errors

    try:
        return get_settings()
    except ValidationError as e:
        raise click.ClickException(settings_errors(e)) from e
