"""Cross-cutting HTTP concerns: security headers, body size limit, per-token rate limit."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class BodyTooLarge(HTTPException):
    """An HTTPException, so that an app reading the body itself answers 413 too."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes")


class BodyLimit:
    """Answers 413 to a body over `max_bytes`: by its Content-Length before reading anything, and
    for a chunked body by counting the bytes as they arrive, never reading past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = refused = False  # the app's response went out / our 413 went out instead

        async def counted() -> Message:
            nonlocal received
            if received > self.max_bytes:  # a reader that caught the error must not go on
                raise BodyTooLarge(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def relay(message: Message) -> None:
            nonlocal started, refused
            if refused:
                return
            if message["type"] == "http.response.start" and not started:
                if received > self.max_bytes:
                    # Whatever the app made of the error (a task group between us wraps it, and
                    # FastAPI then answers 400), the client is told why: 413.
                    refused = True
                    await self._refuse(scope, receive, send)
                    return
                started = True
            await send(message)

        try:
            await self.app(scope, counted, relay)
        except Exception:
            if started or refused or received <= self.max_bytes:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = BodyTooLarge(self.max_bytes).detail
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


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
