"""A real local HTTP server speaking OpenAI chat completions, scripted per test.

Each request to `/v1/chat/completions` takes the next entry of the script (status, headers,
body, delay); the server records every request so a test can check what was sent.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # a dict is sent as JSON, a str as is
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


def chat(
    content: str | None = None, tool_calls: list[dict[str, Any]] | None = None, tokens: int = 30
) -> Reply:
    """A chat-completion reply with text content or tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return Reply(
        body={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": tokens - 10,
                "completion_tokens": 10,
                "total_tokens": tokens,
            },
        }
    )


def tool_call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


class OneSlot:
    """One request served at a time, in the order they came, as llama.cpp's one-slot server
    queues them. A plain Lock is not fair: a request that came later can take it first and starve
    an earlier one past its timeout, which no real server does."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket now served

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._issued = self._issued, self._issued + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class FakeOpenAI:
    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.default: Reply | None = None
        # Set: the reply made from each request's JSON body (a server that reads the prompt).
        self.respond: Callable[[dict[str, Any]], Reply] | None = None
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        # Set: one request at a time, like llama.cpp's server with one slot; the others queue.
        self.serial: OneSlot | None = None
        # Set: a delayed reply goes out at once (a test ends without waiting out a slow one).
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with fake.lock:
                    fake.requests.append(
                        {
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "json": body,
                        }
                    )
                    reply = fake.script.pop(0) if fake.script else fake.default
                    if not fake.script and fake.respond is not None and reply is None:
                        reply = fake.respond(body)
                reply = reply or Reply(status=500, body={"error": {"message": "script exhausted"}})
                if fake.serial is not None:
                    with fake.serial:
                        fake.release.wait(reply.delay_s)
                else:
                    fake.release.wait(reply.delay_s)
                data = (
                    reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
                ).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # A unique path per server: circuit breakers are per URL, and ports get reused.
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{uuid.uuid4().hex[:8]}/v1"

    def then(self, *replies: Reply) -> FakeOpenAI:
        self.script.extend(replies)
        return self


@contextmanager
def serving(fake: FakeOpenAI) -> Iterator[FakeOpenAI]:
    """``fake`` answering on its port from a thread until the block ends."""
    thread = threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    with serving(FakeOpenAI()) as fake:
        yield fake
