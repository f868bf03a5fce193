"""Prometheus metrics for every HTTP service: ``install(app, service)`` adds ``GET /metrics``,
request counts and latency per route (the route's template, never the raw path), and takes the
run id from the ``X-GTR-Run-Id`` header into the logs (``shared.logs``).

Service metrics (env steps, generated tokens and batch sizes, corrections) are process-wide
objects here that the services update; the API adds database-backed ones (runs by status,
corrections per corrector, queue depths: ``services.api.prom``) through ``extra``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from shared.logs import RUN_HEADER, run_context

REQUESTS = Counter(
    "gtr_http_requests_total",
    "HTTP requests by route and status",
    ["service", "method", "route", "status"],
)
LATENCY = Histogram(
    "gtr_http_request_duration_seconds",
    "HTTP request latency by route",
    ["service", "method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENV_STEPS = Counter("gtr_env_steps_total", "Env steps taken (rate() = env steps/s)")
ENV_BATCH = Histogram(
    "gtr_env_step_batch_size", "Sessions stepped per batched call", buckets=BATCHES
)
POLICY_TOKENS = Counter("gtr_policy_generated_tokens_total", "Tokens generated (rate() = tokens/s)")
POLICY_BATCH = Histogram("gtr_policy_batch_size", "Samples per model call", buckets=BATCHES)
CORRECTIONS = Counter(
    "gtr_corrector_requests_total", "Corrections served by verdict", ["backend", "outcome"]
)
CORRECTION_LATENCY = Histogram(
    "gtr_corrector_latency_seconds",
    "Correction latency",
    ["backend"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
CORRECTION_TOKENS = Counter("gtr_corrector_tokens_total", "Corrector tokens spent", ["backend"])


class MetricsMiddleware:
    """Pure ASGI (streams pass through untouched): counts and times each request."""

    def __init__(self, app: Any, service: str) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        started = time.perf_counter()
        run = _run_id(scope)
        try:
            with run_context(run):
                await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "<unmatched>"
            method = scope.get("method", "")
            LATENCY.labels(self.service, method, route).observe(time.perf_counter() - started)
            REQUESTS.labels(self.service, method, route, str(status[0])).inc()


def _run_id(scope: dict) -> int | None:
    want = RUN_HEADER.lower().encode()
    for k, v in scope.get("headers", []):
        if k == want:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def exposition(extra: CollectorRegistry | None = None) -> bytes:
    """The process-wide metrics, and the caller's own registry after them."""
    out = generate_latest(REGISTRY)
    return out + generate_latest(extra) if extra is not None else out


def install(app: Any, service: str, extra: CollectorRegistry | None = None) -> None:
    """``GET /metrics`` and the request metrics on a FastAPI app (a line in its ``create_app``)."""
    from fastapi import Response

    async def metrics() -> Response:
        return Response(exposition(extra), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(MetricsMiddleware, service=service)
