"""Cross-cutting HTTP concerns: security headers, per-token rate limit (the body size limit is
``shared.body_limit``, for the internal services too)."""

from __future__ import annotations

import hashlib
import ipaddress
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
        self.good: OrderedDict[str, bool] = OrderedDict()  # credentials seen to authenticate
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
        auth = request.headers.get("authorization") or request.cookies.get("gtr_token")
        credential = self._key(request) if auth else None
        held = False  # a place in the address's failure window, held while the request runs
        with self.lock:
            if self.failures_per_minute > 0:
                failed = self._window(self.failures, address, now)
                if len(failed) >= self.failures_per_minute:
                    return self._refuse(
                        failed, now, "too many failed authentications from this address"
                    )
                # Checked and recorded at once: a request that may fail authentication (no
                # credential seen to work) takes its place now, so parallel wrong tokens
                # cannot all pass the check before the first failure is counted.
                if credential is None or credential not in self.good:
                    failed.append(now)
                    held = True
            if self.per_minute > 0 and path.startswith("/api"):
                window = self._window(self.hits, self._key(request), now)
                if len(window) >= self.per_minute:
                    return self._refuse(
                        window, now, f"rate limit of {self.per_minute} requests per minute exceeded"
                    )
                window.append(now)
        try:
            response = await call_next(request)
        except BaseException:
            self._settle(address, now, held, failed_auth=False, credential=None)
            raise
        failed_auth = response.status_code == 401 or getattr(request.state, "auth_failed", False)
        self._settle(address, now, held, failed_auth, credential)
        return response

    def _settle(
        self, address: str, held_at: float, held: bool, failed_auth: bool, credential: str | None
    ) -> None:
        """Keep the held place of a failed authentication, give back that of any other."""
        if self.failures_per_minute <= 0:
            return
        with self.lock:
            window = self._window(self.failures, address, time.monotonic())
            if held and not failed_auth:
                try:
                    window.remove(held_at)
                except ValueError:  # it aged out of the window meanwhile
                    pass
            elif failed_auth and not held:
                window.append(time.monotonic())
            if credential is not None:
                if failed_auth:
                    self.good.pop(credential, None)
                else:
                    self.good[credential] = True
                    self.good.move_to_end(credential)
                    while len(self.good) > self.max_keys:
                        self.good.popitem(last=False)


def _address(request: Request) -> str:
    """The client's address; an IPv6 client is counted per /64 (one host's usual share), an
    IPv4-mapped one as its IPv4 address."""
    host = request.client.host if request.client else "?"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host
