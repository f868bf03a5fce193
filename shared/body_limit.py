"""A limit on the size of a request's body, for every HTTP app of the platform (the API and the
internal services): 413 before a byte of an over-long body is read, or as soon as a chunked one
passes the limit."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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
