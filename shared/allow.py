"""`405 Method Not Allowed` names every method the path has.

Starlette answers 405 from the first route whose path matches, so a path served by two routes
(`GET` in one, `POST` in another) advertised only the first's methods in `Allow`. This wraps
an app so that a 405 on a documented path lists the methods its OpenAPI document gives it.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


class AllowEveryMethod:
    def __init__(self, app: ASGIApp, documented: Any) -> None:
        self.app = app
        self.documented = documented  # the FastAPI app: its openapi() is read at the first 405
        self._paths: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def relay(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                allow = self._allow(scope["path"])
                if allow:
                    MutableHeaders(scope=message)["allow"] = allow
            await send(message)

        await self.app(scope, receive, relay)

    def _allow(self, path: str) -> str | None:
        if self._paths is None:
            self._paths = [
                (
                    re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(p)) + "$"),
                    ", ".join(sorted(m.upper() for m in item if m in _METHODS)),
                )
                # a literal path before a templated one it also matches (/envs/step is not
                # /envs/{session_id}): fewer parameters first
                for p, item in sorted(
                    self.documented.openapi().get("paths", {}).items(),
                    key=lambda kv: kv[0].count("{"),
                )
            ]
        return next((allow for pattern, allow in self._paths if pattern.match(path)), None)
