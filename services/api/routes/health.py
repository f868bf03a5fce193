"""Liveness and readiness probes, and the API's detailed metrics for an admin."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text

from services.api.auth import require_admin
from shared.db.models import ApiToken
from shared.db.session import get_engine
from shared.settings import get_settings

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz() -> JSONResponse:
    """The database (and Redis, when configured) answer."""
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as e:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(e).__name__}"
    redis_url = get_settings().redis_url
    if redis_url:
        import redis

        try:
            redis.Redis.from_url(redis_url, socket_timeout=2).ping()
            checks["redis"] = "ok"
        except Exception as e:  # noqa: BLE001
            checks["redis"] = f"error: {type(e).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
    )


@router.get(
    "/api/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}},
)
def detailed_metrics(token: Annotated[ApiToken, Depends(require_admin)]) -> Response:
    """The store's Prometheus series per corrector registry id and per run id (the open
    ``/metrics`` aggregates them); an admin token, which sees every team."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from services.api.prom import api_registry

    return Response(generate_latest(api_registry(detailed=True)), media_type=CONTENT_TYPE_LATEST)
