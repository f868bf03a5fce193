"""Security of a shared deployment: tokens, scopes, teams, corrector keys, allowlist, rate limit,
security headers, and no secret in any log of a whole run. Real uvicorn servers on PostgreSQL."""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import select

from services.api.app import create_app
from services.api.auth import create_token
from services.controller.stack import _wait_healthy
from services.corrector.base import CorrectorError
from services.corrector.keys import decrypt_key
from shared.db.models import ApiToken, Corrector, Run
from shared.db.session import session_scope
from shared.settings import Settings, get_settings
from tests.conftest import free_port, live_server
from tests.e2e.helpers import ROOT, tiny_config
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat

KEY = "sk-live-SECRET-4f7c2a9e1b"


def _pg_dump(url: str) -> str:
    """The whole test database as SQL text: what an attacker with a backup would read."""
    parts = urlsplit(url.replace("+psycopg", ""))
    out = subprocess.run(
        [
            "pg_dump",
            "-h",
            parts.hostname or "",
            "-p",
            str(parts.port or 5432),
            "-U",
            "postgres",
            "--data-only",
            parts.path.lstrip("/"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict[str, Any]]:
    tokens = {}
    with session_scope() as s:
        for name, scope, team in [
            ("a-read", "read", "alpha"),
            ("a-write", "write", "alpha"),
            ("b-write", "write", "beta"),
            ("admin", "admin", "ops"),
        ]:
            tokens[name] = create_token(s, f"sec-{name}", scope, team)[1]
    with live_server(create_app()) as url:
        yield {"url": url, "tokens": tokens, "pg_url": pg_url}


def _h(api: dict, who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api['tokens'][who]}"}


def _call(api: dict, method: str, path: str, who: str | None = None, **kw: Any) -> httpx.Response:
    headers = {**(_h(api, who) if who else {}), **kw.pop("headers", {})}
    return httpx.request(method, api["url"] + path, headers=headers, timeout=30, **kw)


def test_tokens_are_stored_hashed_and_compared_in_constant_time(api: dict, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    raw = api["tokens"]["a-write"]
    with session_scope() as s:
        row = s.scalar(select(ApiToken).where(ApiToken.name == "sec-a-write"))
        assert row is not None and row.token_hash == hashlib.sha256(raw.encode()).hexdigest()
        assert len(row.prefix) < len(raw) // 3  # only a short prefix, to tell tokens apart
    dump = _pg_dump(api["pg_url"])
    assert row.token_hash in dump  # the dump does hold the token table ...
    assert all(t not in dump for t in api["tokens"].values())  # ... but no secret in clear
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a, b):  # type: ignore[no-untyped-def]
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("services.api.auth.hmac.compare_digest", spy)
    assert _call(api, "GET", "/api/me", "a-write").json()["team"] == "alpha"
    assert compared and compared[-1][0] == compared[-1][1] == row.token_hash
    bad = raw[:-2] + ("xy" if not raw.endswith("xy") else "zz")
    assert (
        _call(api, "GET", "/api/me", headers={"Authorization": f"Bearer {bad}"}).status_code == 401
    )


def _launch(api: dict, who: str) -> int:
    r = _call(api, "POST", "/api/runs", who, json={"name": "sec", "task": "numberline"})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_scopes_read_cannot_write_and_only_admin_manages_correctors(api: dict) -> None:
    r = _call(api, "POST", "/api/runs", "a-read", json={"name": "x", "task": "numberline"})
    assert r.status_code == 403 and "read-only" in r.json()["detail"]
    run_id = _launch(api, "a-write")
    assert _call(api, "POST", f"/api/runs/{run_id}/cancel", "a-read").status_code == 403
    body = {"name": "sec-scope", "kind": "oracle"}
    for who in ("a-read", "a-write", "b-write"):
        assert _call(api, "POST", "/api/correctors", who, json=body).status_code == 403
    created = _call(api, "POST", "/api/correctors", "admin", json=body)
    assert created.status_code == 201
    cid = created.json()["id"]
    for who in ("a-write", "b-write"):
        assert (
            _call(api, "PATCH", f"/api/correctors/{cid}", who, json={"params": {}}).status_code
            == 403
        )
        assert _call(api, "DELETE", f"/api/correctors/{cid}", who).status_code == 403
    assert _call(api, "DELETE", f"/api/correctors/{cid}", "admin").status_code == 204
    assert (
        _call(api, "POST", f"/api/runs/{run_id}/cancel", "a-write").json()["status"] == "cancelled"
    )


def test_a_team_cannot_see_or_cancel_another_teams_run(api: dict) -> None:
    run_id = _launch(api, "a-write")
    for path in ("", "/updates", "/episodes", "/corrections", "/checkpoints"):
        r = _call(api, "GET", f"/api/runs/{run_id}{path}", "b-write")
        assert r.status_code == 404, (path, r.status_code)
        assert _call(api, "GET", f"/api/runs/{run_id}{path}", "a-read").status_code == 200
    assert run_id not in [
        r["id"] for r in _call(api, "GET", "/api/runs?limit=500", "b-write").json()["items"]
    ]
    assert run_id in [
        r["id"] for r in _call(api, "GET", "/api/runs?limit=500", "a-read").json()["items"]
    ]
    assert _call(api, "POST", f"/api/runs/{run_id}/cancel", "b-write").status_code == 404
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "queued" and not run.cancel_requested
    assert _call(api, "GET", f"/api/runs/{run_id}", "admin").json()["team"] == "alpha"
    assert _call(api, "POST", f"/api/runs/{run_id}/cancel", "admin").json()["status"] == "cancelled"


def test_corrector_keys_are_encrypted_at_rest_and_never_returned(api: dict, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("DEBUG")
    body = {
        "name": "sec-keyed",
        "kind": "openai",
        "base_url": "https://api.example.com/v1",
        "model": "gpt-x",
        "api_key": KEY,
    }
    responses = [_call(api, "POST", "/api/correctors", "admin", json=body)]
    assert responses[0].status_code == 201 and responses[0].json()["api_key_set"] is True
    cid = responses[0].json()["id"]
    responses += [
        _call(api, "GET", "/api/correctors", "admin"),
        _call(api, "GET", f"/api/correctors/{cid}", "admin"),
        _call(api, "PATCH", f"/api/correctors/{cid}", "admin", json={"model": "gpt-y"}),
        _call(api, "POST", "/api/correctors", "admin", json=body),  # 409 duplicate
        _call(
            api,
            "POST",
            "/api/correctors",
            "admin",
            json={**body, "name": "bad", "base_url": "ftp://x"},
        ),
        _call(api, "GET", f"/api/correctors/{cid}/stats", "admin"),
        _call(api, "GET", "/correctors", cookies={"gtr_token": api["tokens"]["admin"]}),
    ]
    assert [r.status_code for r in responses][4:6] == [409, 422]
    for r in responses:
        assert KEY not in r.text and KEY[8:20] not in r.text
    with session_scope() as s:
        row = s.get(Corrector, cid)
        assert row is not None and row.api_key_encrypted and KEY not in row.api_key_encrypted
        assert decrypt_key(row, get_settings()) == KEY  # encrypted, not lost
        with pytest.raises(CorrectorError, match="does not decrypt"):  # another secret can't
            decrypt_key(row, Settings(secret_key="another secret"))  # type: ignore[arg-type]
    assert KEY not in _pg_dump(api["pg_url"])
    assert KEY not in caplog.text
    assert _call(api, "DELETE", f"/api/correctors/{cid}", "admin").status_code == 204


def test_the_base_url_allowlist_is_enforced(api: dict, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GTR_CORRECTOR_URL_ALLOWLIST", '["api.openai.com", "127.0.0.1"]')
    get_settings.cache_clear()
    try:
        body = {"name": "sec-allow", "kind": "openai", "model": "m"}
        for url in (
            "https://evil.example.com/v1",
            "http://169.254.169.254/latest",
            "https://api.openai.com.evil.example/v1",
            "http://user:pw@api.openai.com/v1",
        ):
            r = _call(api, "POST", "/api/correctors", "admin", json={**body, "base_url": url})
            assert r.status_code == 422, (url, r.text)
        ok = _call(
            api,
            "POST",
            "/api/correctors",
            "admin",
            json={**body, "base_url": "https://api.openai.com/v1"},
        )
        assert ok.status_code == 201, ok.text
        moved = _call(
            api,
            "PATCH",
            f"/api/correctors/{ok.json()['id']}",
            "admin",
            json={"base_url": "https://evil.example.com/v1"},
        )
        assert moved.status_code == 422 and "allowlist" in moved.text
        with session_scope() as s:
            row = s.get(Corrector, ok.json()["id"])
            assert row is not None and row.base_url == "https://api.openai.com/v1"
        assert (
            _call(api, "DELETE", f"/api/correctors/{ok.json()['id']}", "admin").status_code == 204
        )
    finally:
        get_settings.cache_clear()


def test_the_api_rate_limit_answers_429_with_retry_after(api: dict) -> None:
    app = create_app(Settings(api_rate_limit_per_minute=5))
    with live_server(app) as url:
        codes = [
            httpx.get(f"{url}/api/me", headers=_h(api, "a-read")).status_code for _ in range(7)
        ]
        assert codes == [200] * 5 + [429] * 2
        limited = httpx.get(f"{url}/api/me", headers=_h(api, "a-read"))
        assert limited.status_code == 429 and 0 < int(limited.headers["Retry-After"]) <= 61
        assert "rate limit" in limited.json()["detail"]
        # Per token: another caller is not limited by the first one's traffic.
        assert httpx.get(f"{url}/api/me", headers=_h(api, "b-write")).status_code == 200


@pytest.mark.parametrize("path", ["/login", "/runs", "/correctors", "/api/me", "/nope"])
def test_security_headers_on_every_page(api: dict, path: str) -> None:
    r = _call(api, "GET", path, cookies={"gtr_token": api["tokens"]["a-read"]})
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["X-Frame-Options"] == "DENY"
    csp = r.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'self'" in csp
    assert r.headers["Referrer-Policy"] == "same-origin"


def test_login_cookie_is_httponly_and_strict(api: dict) -> None:
    r = httpx.post(f"{api['url']}/login", data={"token": api["tokens"]["a-read"], "next": "/runs"})
    assert r.status_code == 303
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    evil = httpx.post(
        f"{api['url']}/login",
        data={"token": api["tokens"]["a-read"], "next": "https://evil.example/"},
    )
    assert evil.headers["location"].startswith("/")  # no open redirect after login


# ---- no secret in the logs of a whole run ------------------------------------------------------

YES = '{"answer1": "the numbers", "evaluation": "YES", "correction": null}'


def _gtr(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


@pytest.mark.slow
def test_no_secret_in_the_logs_of_a_whole_run(tmp_path: Path, warm_checkpoint: Path) -> None:
    """Embedded mode at DEBUG: the token goes in over REST, the key is registered over REST and
    used by every corrector call of a `gtr train` run; neither appears in any log or store file."""
    fake = FakeOpenAI()
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    # Some calls fail (a 500, garbage): their errors are logged too, and must not leak either.
    fake.then(Reply(500, {"error": {"message": "boom"}}), chat(YES), Reply(body="<html>"))
    fake.default = chat(YES)
    data = tmp_path / "gtr-data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env.update(
        GTR_DATA_DIR=str(data),
        GTR_SECRET_KEY="test-secret-for-this-run",
        GTR_LOG_LEVEL="DEBUG",
        GTR_TORCH_THREADS="1",
        GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS="true",  # the fake endpoint listens on 127.0.0.1
    )
    made = _gtr(["token", "create", "root", "--admin"], env)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    port = free_port()
    logs = [tmp_path / "serve.log"]
    with open(logs[0], "wb") as out:  # the embedded environment only: no GTR_* of the test session
        api = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy("api", url, api)
        auth = {"Authorization": f"Bearer {token}"}
        r = httpx.post(
            f"{url}/api/correctors",
            headers=auth,
            timeout=30,
            json={
                "name": "gpt-fake",
                "kind": "openai",
                "base_url": fake.url,
                "model": "gpt-test",
                "api_key": KEY,
                "params": {"max_retries": 0, "timeout_s": 20},
            },
        )
        assert r.status_code == 201, r.text
        cfg = tmp_path / "run.toml"
        cfg.write_text(
            tiny_config(warm_checkpoint, envs=2, steps=4, updates=1).replace(
                "[corrector]\n", '[corrector]\nname = "gpt-fake"\n'
            )
        )
        run = _gtr(["train", str(cfg)], env)
        (tmp_path / "train.log").write_text(run.stdout + run.stderr)
        logs.append(tmp_path / "train.log")
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        corrections = httpx.get(f"{url}/api/runs/1/corrections?limit=500", headers=auth).json()
    finally:
        api.terminate()
        api.wait(timeout=20)
        fake.server.shutdown()
    statuses = {c["status"] for c in corrections["items"]}
    assert fake.requests and statuses == {"done", "failed"}, (len(fake.requests), statuses)
    assert all(q["headers"]["authorization"] == f"Bearer {KEY}" for q in fake.requests)
    files = logs + sorted(p for p in data.rglob("*") if p.is_file() and p.suffix != ".png")
    for path in files:
        blob = path.read_bytes()
        assert KEY.encode() not in blob and token.encode() not in blob, f"a secret in {path}"
    text = "".join(p.read_text(errors="replace") for p in logs)
    # The logs were written: the access log of the key's request, the run's progress and end.
    assert "POST /api/correctors" in text and "completed" in text
