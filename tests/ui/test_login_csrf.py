"""Login CSRF in Chromium (issue 43 item 3): a foreign page whose form submits itself to our
`/login` with the attacker's token must not log the visitor in (the visitor would then act in
the attacker's team), nor one posting to `/logout` log them out."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from services.api.auth import create_token
from shared.db.session import session_scope
from tests.ui.conftest import login
from tests.ui.seed import Seeded


@contextmanager
def _foreign_site(pages: dict[str, str]) -> Iterator[str]:
    """Another site (localhost, where the app is 127.0.0.1) serving the attacker's pages."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200 if body else 404)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _self_submitting(action: str, fields: dict[str, str]) -> str:
    inputs = "".join(f'<input name="{k}" value="{v}">' for k, v in fields.items())
    return (
        f'<form id="f" method="post" action="{action}">{inputs}</form>'
        '<script>document.getElementById("f").submit()</script>'
    )


@pytest.fixture
def attacker(base_url: str, seeded: Seeded) -> Iterator[tuple[str, str]]:
    with session_scope() as s:
        theirs = create_token(s, "csrf-attacker", "write", "attackers")[1]
    pages = {
        "/login": _self_submitting(f"{base_url}/login", {"token": theirs, "next": "/runs"}),
        "/logout": _self_submitting(f"{base_url}/logout", {}),
    }
    with _foreign_site(pages) as url:
        yield url, theirs


def _cookie(page: Any, base_url: str) -> str | None:
    found = [c["value"] for c in page.context.cookies(base_url) if c["name"] == "gtr_token"]
    return found[0] if found else None


def test_a_foreign_page_can_neither_log_a_visitor_in_nor_out(
    page: Any, base_url: str, seeded: Seeded, attacker: tuple[str, str]
) -> None:
    site, theirs = attacker
    page.goto(f"{site}/login")
    page.wait_for_load_state("networkidle")
    assert page.url.startswith(f"{base_url}/login") and "cross-origin" in page.content()
    assert _cookie(page, base_url) is None  # not logged in as the attacker's team
    login(page, base_url, seeded.write_token)
    assert _cookie(page, base_url) == seeded.write_token
    page.goto(f"{site}/logout")
    page.wait_for_load_state("networkidle")
    assert _cookie(page, base_url) == seeded.write_token  # still logged in, as themselves
    assert theirs != seeded.write_token
