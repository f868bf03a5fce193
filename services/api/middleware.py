"""Cross-cutting HTTP concerns: security headers, per-token rate limit (the body size limit is
``shared.body_limit``, for the internal services too)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
        "script-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
}


class SecurityHeaders(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response


PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # never limited: probes and scrapes


class RateLimit(BaseHTTPMiddleware):
    """Sliding one-minute windows: requests per API token (or client address without one) on
    /api, and failed authentications (401s, failed logins, a wrong cookie on a page) per client
    address. Wrong tokens are counted against the address, so changing the token does not
    escape the limit; an address over it gets 429 on every path but the probes'. Both tables
    keep at most `max_keys` keys (least recently seen dropped). The address is the peer's, or
    the one a trusted proxy forwarded (uvicorn's ``forwarded_allow_ips``: GTR_TRUSTED_PROXIES)."""

    def __init__(  # type: ignore[no-untyped-def]
        self, app, per_minute: int, failures_per_minute: int = 0, max_keys: int = 10_000
    ) -> None:
        super().__init__(app)
        self.per_minute = per_minute
        self.failures_per_minute = failures_per_minute
        self.max_keys = max_keys
        self.hits: OrderedDict[str, deque[float]] = OrderedDict()
        self.failures: OrderedDict[str, deque[float]] = OrderedDict()
        self.lock = threading.Lock()

    def _key(self, request: Request) -> str:
        auth = request.headers.get("authorization") or request.cookies.get("gtr_token") or ""
        if auth:
            return hashlib.sha256(auth.encode("utf-8", "replace")).hexdigest()
        return _address(request)

    def _window(self, table: OrderedDict[str, deque[float]], key: str, now: float) -> deque:
        window = table.get(key)
        if window is None:
            window = table[key] = deque()
            while len(table) > self.max_keys:
                table.popitem(last=False)
        table.move_to_end(key)
        while window and now - window[0] > 60:
            window.popleft()
        return window

    def _refuse(self, window: deque, now: float, what: str) -> Response:
        retry = max(1, int(61 - (now - window[0])))
        return JSONResponse({"detail": what}, status_code=429, headers={"Retry-After": str(retry)})

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        path = request.url.path
        if path in PROBES:
            return await call_next(request)
        now, address = time.monotonic(), _address(request)
        with self.lock:
            if self.failures_per_minute > 0:
                failed = self._window(self.failures, address, now)
                if len(failed) >= self.failures_per_minute:
                    return self._refuse(
                        failed, now, "too many failed authentications from this address"
                    )
            if self.per_minute > 0 and path.startswith("/api"):
                window = self._window(self.hits, self._key(request), now)
                if len(window) >= self.per_minute:
                    return self._refuse(
                        window, now, f"rate limit of {self.per_minute} requests per minute exceeded"
                    )
                window.append(now)
        response = await call_next(request)
        failed_auth = response.status_code == 401 or getattr(request.state, "auth_failed", False)
        if self.failures_per_minute > 0 and failed_auth:
            with self.lock:
                self._window(self.failures, address, time.monotonic()).append(time.monotonic())
        return response


def _address(request: Request) -> str:
    return request.client.host if request.client else "?"
