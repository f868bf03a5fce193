"""Security round 4 (issue 57), each attack tried as an outsider would, on real servers: another
team's corrector key variable, games outside their roots on the env and policy services, hostile
study bundles, the racing auth limit, the open /metrics, IPv6 forms embedding IPv4, invisible
CSV prefixes, strict types on the corrector `/test`, and nested routes naming another parent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from services.api.app import create_app
from services.api.auth import create_token
from services.corrector.tasks import correct as correct_task
from shared.db import models
from shared.db.session import session_scope
from tests.conftest import live_server
from tests.services.corrector.helpers import make_step

TEAMS = [
    ("alpha", "write", "alpha"),
    ("alpha-admin", "admin", "alpha"),
    ("beta", "write", "beta"),
    ("beta-read", "read", "beta"),
]


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict[str, Any]]:
    tokens = {}
    with session_scope() as s:
        for name, scope, team in TEAMS:
            tokens[name] = create_token(s, f"round4-{name}", scope, team)[1]
    with live_server(create_app()) as url:
        yield {"url": url, "tokens": tokens}


def _call(api: dict, method: str, path: str, who: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api['tokens'][who]}", **kw.pop("headers", {})}
    return httpx.request(method, api["url"] + path, headers=headers, timeout=60, **kw)


def _count(model: Any) -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def _refused_422(r: httpx.Response, loc: list[str], text: str = "") -> str:
    assert r.status_code == 422, (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", *loc], detail
    assert text in detail[0]["msg"], detail
    return str(detail[0]["msg"])


class Capture:
    """A real local HTTP server standing in for a team's corrector endpoint: it records every
    request's path and Authorization header and answers 500 (nothing is meant to reach it)."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.hits.append((self.path, self.headers.get("authorization")))
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def capture() -> Iterator[Capture]:
    server = Capture()
    yield server
    server.close()


# ---- 1: another team's corrector key variable ---------------------------------------------------

ALPHA_KEY = "sk-alpha-private-" + "k" * 20


def test_an_inline_corrector_cannot_name_another_teams_key(
    api: dict, capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GTR_CORRECTOR_KEY_TEAMA", ALPHA_KEY)
    alpha_url = "https://alpha-corrector.example/v1"
    made = _call(
        api,
        "POST",
        "/api/correctors",
        "alpha-admin",
        json={
            "name": "alpha-private",
            "kind": "http",
            "base_url": alpha_url,
            "api_key_env": "GTR_CORRECTOR_KEY_TEAMA",
        },
    )
    assert made.status_code == 201, made.text
    before = _count(models.Run)
    # beta sends alpha's key to its own server, to alpha's own server, or names a variable no
    # corrector registers: one refusal, before any row is written
    for var, url in [
        ("GTR_CORRECTOR_KEY_TEAMA", capture.url),
        ("GTR_CORRECTOR_KEY_TEAMA", alpha_url),
        ("GTR_CORRECTOR_KEY_UNREGISTERED", capture.url),
    ]:
        inline = {"kind": "http", "base_url": url, "api_key_env": var}
        r = _call(
            api, "POST", "/api/runs", "beta", json={"task": "numberline", "corrector": inline}
        )
        msg = _refused_422(r, ["corrector", "api_key_env"], "is not a key of team 'beta'")
        assert ALPHA_KEY not in msg
    assert _count(models.Run) == before
    # alpha may send its key inline to the endpoint it registered it for, and nowhere else
    mine = {"kind": "http", "base_url": alpha_url, "api_key_env": "GTR_CORRECTOR_KEY_TEAMA"}
    ok = _call(api, "POST", "/api/runs", "alpha", json={"task": "numberline", "corrector": mine})
    assert ok.status_code == 201, ok.text
    elsewhere = {**mine, "base_url": capture.url}
    r = _call(
        api, "POST", "/api/runs", "alpha", json={"task": "numberline", "corrector": elsewhere}
    )
    _refused_422(r, ["corrector", "api_key_env"])

    # A run stored before the launch check (or edited in the database): the real worker refuses
    # it too, before anything is sent.
    inline = {"kind": "http", "base_url": capture.url, "api_key_env": "GTR_CORRECTOR_KEY_TEAMA"}
    with session_scope() as s:
        run = models.Run(
            name="b", team="beta", task="numberline", algorithm="gtr", total_env_steps=1,
            num_updates=1, config={"task": "numberline", "corrector": {"name": "inline", **inline}},
        )  # fmt: skip
        s.add(run)
        s.flush()
        step_id = make_step(s, "numberline", {"position": 1, "target": 3}, "+", run=run).id
    assert correct_task(step_id, "inline")["status"] == "failed"
    with session_scope() as s:
        row = s.scalar(select(models.Correction).where(models.Correction.step_id == step_id))
        assert row is not None and row.error is not None
        assert "is not a key of team 'beta'" in row.error, row.error
    assert capture.hits == []  # zero requests reached beta's server: alpha's key never left
