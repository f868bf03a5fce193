"""Security round 3 (issue 43), each attack tried as an outsider would, on real servers: a
corrector endpoint that redirects inward, login and logout from a foreign page, games folders
outside their roots, addresses that dodge the failed-authentication limit, an inline corrector's
key variable, and the smaller leaks (CSV header, TOML clone, search totals, error echoes,
/metrics labels, the policy's /healthz)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select

from services.api.app import create_app
from services.api.auth import create_token
from services.api.routes.search import _csv
from services.api.service import config_toml
from services.corrector.service import build_corrector, record_correction
from services.env.app import create_app as env_app
from services.env.service import EnvError, EnvPool
from shared.db import models
from shared.db.session import session_scope
from shared.paths import GAMES_NOT_FOUND
from shared.settings import Settings, get_settings
from shared.toml import NoToml, dumps
from tests.conftest import RealRun, free_port, live_server, need, wait_serving
from tests.faults.client import call as _call
from tests.faults.client import count as _count
from tests.faults.client import refused_422 as _refused_422
from tests.services.corrector.conftest import FakeOpenAI, chat
from tests.services.corrector.helpers import make_step

TOKEN = "round3-service-token-" + "r" * 32


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict[str, Any]]:
    tokens = {}
    with session_scope() as s:
        for name, scope, team in [("ops", "admin", "ops"), ("alpha", "write", "alpha")]:
            tokens[name] = create_token(s, f"round3-{name}", scope, team)[1]
    with live_server(create_app()) as url:
        yield {"url": url, "tokens": tokens}


# ---- 1: a corrector endpoint that redirects to an internal address -----------------------------


class _Server:
    """A real local HTTP server: every request is recorded and answered by `answer`."""

    def __init__(self, answer: Any) -> None:
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                outer.hits.append(self.path)
                status, headers = answer(self.path)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
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
def redirect_inward() -> Iterator[tuple[_Server, _Server]]:
    inner = _Server(lambda path: (418, {}))  # the "internal service" the redirect points at
    outer = _Server(lambda path: (307, {"Location": inner.url + path}))
    yield outer, inner
    outer.close()
    inner.close()


def _strings(x: object) -> list[str]:
    """Every string inside a JSON value (keys and values, at any depth)."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [t for k, v in x.items() for t in [k, *_strings(v)]]
    if isinstance(x, list):
        return [t for v in x for t in _strings(v)]
    return []


def test_no_corrector_kind_follows_a_redirect(
    api: dict, redirect_inward: tuple[_Server, _Server]
) -> None:
    outer, inner = redirect_inward
    for kind in ("openai", "http"):
        body = {"name": f"redirector-{kind}", "kind": kind, "base_url": outer.url + "/v1"}
        made = _call(api, "POST", "/api/correctors", "ops", json={**body, "model": "m"})
        assert made.status_code == 201, made.text
        r = _call(api, "POST", f"/api/correctors/{made.json()['id']}/test", "ops")
        assert r.status_code == 200 and r.json()["ok"] is False, r.text
        assert r.json()["error"].startswith("transport: the endpoint answered HTTP 307"), r.text
        # the internal service's 418 is disclosed in no text of the answer (its timings are
        # floats whose digits may hold "418")
        assert not any("418" in t for t in _strings(r.json())), r.text
        assert "redirect" in r.json()["error"], r.text
    assert outer.hits and inner.hits == []  # the step body never reached the inner server


# ---- 3: login and logout from a foreign page ----------------------------------------------------

FOREIGN = [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},  # a sibling subdomain is another origin
]


def test_login_and_logout_from_a_foreign_page_are_refused(api: dict) -> None:
    url, theirs = api["url"], api["tokens"]["alpha"]
    for headers in FOREIGN:
        r = httpx.post(f"{url}/login", data={"token": theirs}, headers=headers)
        assert r.status_code == 403 and "cross-origin" in r.text, (headers, r.status_code)
        assert "set-cookie" not in r.headers, headers
        for method in ("POST", "GET"):
            out = httpx.request(
                method, f"{url}/logout", headers=headers, cookies={"gtr_token": theirs}
            )
            assert out.status_code == 403 and "set-cookie" not in out.headers, (method, headers)
        # The other cookie writes follow the same rule (same-site was let through before).
        run = httpx.post(
            f"{url}/api/runs",
            json={"task": "numberline"},
            headers=headers,
            cookies={"gtr_token": theirs},
        )
        assert run.status_code == 403, (headers, run.text)
    ours = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    r = httpx.post(f"{url}/login", data={"token": theirs}, headers=ours)
    assert r.status_code == 303 and r.cookies.get("gtr_token") == theirs
    out = httpx.post(f"{url}/logout", headers=ours, cookies={"gtr_token": theirs})
    assert out.status_code == 303 and 'gtr_token=""' in out.headers["set-cookie"]
    typed = httpx.get(f"{url}/logout", headers={"Sec-Fetch-Site": "none"})  # an address typed in
    assert typed.status_code == 303


# ---- 4: the failed-authentication limit cannot be dodged ---------------------------------------


def _bad_bearers(url: str, n: int, forwarded: bool = True) -> list[int]:
    return [
        httpx.get(
            f"{url}/api/me",
            headers={
                "Authorization": f"Bearer wrong-{i}",
                **({"X-Forwarded-For": f"203.0.113.{i}"} if forwarded else {}),
            },
        ).status_code
        for i in range(n)
    ]


def test_gtr_serve_believes_no_forwarded_address_by_default(pg_url: str) -> None:
    port = free_port()
    env = {**os.environ, "GTR_AUTH_FAILURES_PER_MINUTE": "5", "GTR_API_RATE_LIMIT_PER_MINUTE": "0"}
    env.pop("GTR_TRUSTED_PROXIES", None)
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc)
        assert _bad_bearers(url, 7) == [401] * 5 + [429] * 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_configured_proxy_is_believed() -> None:
    assert Settings().uvicorn_proxy_options() == {"proxy_headers": False}
    trusted = Settings(trusted_proxies=["127.0.0.1"])
    app = create_app(Settings(api_rate_limit_per_minute=0, auth_failures_per_minute=3))
    port = free_port()
    config = uvicorn.Config(app, port=port, log_level="warning", **trusted.uvicorn_proxy_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.02)
        # Behind the proxy each forwarded client is counted on its own ...
        assert _bad_bearers(f"http://127.0.0.1:{port}", 6) == [401] * 6
        # ... and the proxy's own requests as its own.
        assert _bad_bearers(f"http://127.0.0.1:{port}", 4, forwarded=False) == [401] * 3 + [429]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_wrong_cookies_on_pages_count_and_a_blocked_address_gets_no_page(api: dict) -> None:
    with live_server(create_app(Settings(auth_failures_per_minute=3))) as url:
        codes = [
            httpx.get(f"{url}/runs", cookies={"gtr_token": f"wrong-{i}"}).status_code
            for i in range(4)
        ]
        assert codes == [303] * 3 + [429]
        right = httpx.get(f"{url}/runs", cookies={"gtr_token": api["tokens"]["alpha"]})
        assert right.status_code == 429 and "Retry-After" in right.headers
        assert httpx.get(f"{url}/healthz").status_code == 200  # probes stay open


# ---- 5: an inline corrector's key variable ------------------------------------------------------


def test_an_inline_key_variable_outside_the_prefix_is_refused_at_launch(api: dict) -> None:
    inline = {"kind": "openai", "base_url": "https://api.example.com/v1", "model": "m"}
    before = _count(models.Run)
    for var in ("GTR_DATABASE_URL", "HOME", "gtr_corrector_key_x"):
        body = {"task": "numberline", "corrector": {**inline, "api_key_env": var}}
        r = _call(api, "POST", "/api/runs", "alpha", json=body)
        _refused_422(r, ["corrector", "api_key_env"], "GTR_CORRECTOR_KEY_")
    assert _count(models.Run) == before
    # A variable under the prefix: only one a shared (or alpha's) corrector registers for this
    # base_url (test_round4.py: test_an_inline_corrector_cannot_name_another_teams_key).
    reg = {"name": "shared-x", **inline, "api_key_env": "GTR_CORRECTOR_KEY_X"}
    made = _call(api, "POST", "/api/correctors", "ops", json=reg)
    assert made.status_code == 201, made.text
    share = _call(
        api, "PATCH", f"/api/correctors/{made.json()['id']}", "ops", json={"shared": True}
    )
    assert share.status_code == 200, share.text
    ok = {"task": "numberline", "corrector": {**inline, "api_key_env": "GTR_CORRECTOR_KEY_X"}}
    assert _call(api, "POST", "/api/runs", "alpha", json=ok).status_code == 201


# ---- 2: ALFWorld games folders -------------------------------------------------------------------


def _hostile_games(tmp_path: Path) -> list[Any]:
    link = tmp_path / "to-usr"
    link.symlink_to("/usr")
    return ["/usr", "/", "../../../../etc", str(link), "x" * 300, "/" + "y" * 300, "$HOME", ["/"]]


def test_games_folders_are_confined_at_launch(api: dict, tmp_path: Path) -> None:
    before = _count(models.Run)
    for games in _hostile_games(tmp_path):
        body = {"task": "alfworld", "env": {"options": {"games": games}}}
        r = _call(api, "POST", "/api/runs", "alpha", json=body)
        assert _refused_422(r, ["env", "options", "games"]) == GAMES_NOT_FOUND, games
    assert _count(models.Run) == before
    mine = tmp_path / "games"
    mine.mkdir()
    body = {"task": "alfworld", "env": {"options": {"games": [str(mine)]}}}
    made = _call(api, "POST", "/api/runs", "alpha", json=body)
    assert made.status_code == 201, made.text
    assert made.json()["config"]["env"]["options"]["games"] == [str(mine.resolve())]


def _envs_answer_4xx(url: str, tmp_path: Path) -> None:
    for games in _hostile_games(tmp_path):
        body = {"task": "alfworld", "config": {"options": {"games": games}}}
        r = httpx.post(f"{url}/envs", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422, (games, r.status_code, r.text[:300])
        assert r.json()["detail"] == f"env.options.games: {GAMES_NOT_FOUND}", games


def test_the_env_service_confines_games_and_never_answers_5xx(tmp_path: Path) -> None:
    settings = Settings(service_token=TOKEN, games_roots=[tmp_path / "games"])  # type: ignore[arg-type]
    with live_server(env_app(settings=settings)) as url:
        _envs_answer_4xx(url, tmp_path)
    # Without roots (an env pool in the caller's own process) a bad path is still a 4xx.
    with pytest.raises(EnvError):
        EnvPool().create("alfworld", {"options": {"games": "/" + "z" * 300}})


def test_the_alfworld_options_error_names_the_field_not_the_input() -> None:
    need(importlib.util.find_spec("alfworld") is not None, "the alfworld extra is not installed")
    with pytest.raises(EnvError) as echo:
        EnvPool().create("alfworld", {"options": {"observation": "<b>SECRET-INPUT</b>"}})
    assert "observation" in str(echo.value) and "SECRET-INPUT" not in str(echo.value)


def test_the_policy_service_hosted_envs_confine_games_and_hide_paths(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from services.policy.app import create_app as policy_app
    from services.policy.service import Policy

    settings = Settings(  # type: ignore[arg-type]
        service_token=TOKEN, policy_hosts_envs=True, games_roots=[tmp_path / "games"]
    )
    policy = Policy.load(tiny_model_dir, lora_r=4)
    app = policy_app(policy, settings=settings)
    with live_server(app) as url:
        _envs_answer_4xx(f"{url}/env", tmp_path)
        health = httpx.get(f"{url}/healthz")
        assert health.json() == {"ok": True} and str(tiny_model_dir) not in health.text
        assert httpx.get(f"{url}/weights").status_code == 401
        weights = httpx.get(f"{url}/weights", headers={"Authorization": f"Bearer {TOKEN}"})
        assert weights.json() == {"model": str(policy.model_path), "checkpoint": None}


# ---- 7: the smaller ones -------------------------------------------------------------------------


def test_csv_quotes_formulas_in_the_header_and_behind_blanks() -> None:
    columns = ["update", '=HYPERLINK("http://evil.example","x")']
    rows = [{"update": v, columns[1]: 1.0} for v in ("\n=1+2", " =1+2", "\uff1d1+2", "@SUM(A1)")]
    text = "".join(_csv(iter(rows), columns))
    read = list(csv.reader(io.StringIO(text)))
    assert read[0] == ["update", "'" + columns[1]]
    assert [r[0] for r in read[1:]] == ["'" + str(r["update"]) for r in rows]


def test_a_config_with_null_in_a_list_clones_as_json_not_a_shorter_list() -> None:
    config = {"name": "n", "task": "numberline", "env": {"options": {"deals": [1, None, 3]}}}
    with pytest.raises(NoToml):
        dumps(config)
    run = models.Run(name="n", config=config)
    assert json.loads(config_toml(run)) == config


def test_a_search_past_the_end_counts_what_it_found(api: dict, real_run: RealRun) -> None:
    with session_scope() as s:
        thought = s.scalar(
            select(models.Step.thought)
            .where(models.Step.run_id == real_run.run_id, models.Step.thought.is_not(None))
            .limit(1)
        )
    values = re.sub(r'"[^"]*"\s*:', " ", str(thought))  # the search leaves JSON keys out
    word = max(re.findall(r"[A-Za-z]{4,}", values), key=len)
    url = f"{api['url']}/api/runs/{real_run.run_id}/steps"
    auth = {"Authorization": f"Bearer {real_run.read_token}"}
    found = httpx.get(url, params={"q": word, "limit": 500}, headers=auth).json()
    assert found["total"] >= 1
    past = httpx.get(url, params={"q": word, "offset": 10_000}, headers=auth).json()
    assert past["items"] == [] and past["total"] == min(found["total"], 10_000)


def test_open_metrics_name_no_corrector(api: dict, db: Any) -> None:
    fake = FakeOpenAI()
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        fake.default = chat('{"evaluation": "YES"}', tokens=42)
        body = {"name": "beta-secret-project", "kind": "openai", "base_url": fake.url, "model": "m"}
        made = _call(api, "POST", "/api/correctors", "ops", json=body)
        assert made.status_code == 201, made.text
        step = make_step(
            db, "numberline", {"position": 1, "target": 3}, {"thoughts": "go", "action": "+"}
        )
        corrector = build_corrector("beta-secret-project", db, get_settings())
        assert record_correction(db, step.id, "beta-secret-project", corrector).status == "done"
        db.commit()
        text = httpx.get(f"{api['url']}/metrics").text
        assert "beta-secret-project" not in text
        # Open: registered correctors together, no registry id, no run id (issue 57 item 5).
        assert 'gtr_corrector_tokens{corrector="registered"}' in text
        assert f'corrector="{made.json()["id"]}"' not in text and "run_id=" not in text
        # An admin token gets them per registry id.
        assert _call(api, "GET", "/api/metrics", "alpha").status_code == 403
        detail = _call(api, "GET", "/api/metrics", "ops").text
        assert "beta-secret-project" not in detail
        assert f'gtr_corrector_tokens{{corrector="{made.json()["id"]}"}} 42.0' in detail
    finally:
        fake.server.shutdown()
        fake.server.server_close()


# ---- 6: what schemathesis --checks all found by hand-checkable examples ----------------------


def test_a_405_allows_every_documented_method_of_the_path(api: dict) -> None:
    for path, allowed in [("/api/runs", "GET, POST"), ("/api/correctors/1", "DELETE, GET, PATCH")]:
        r = _call(api, "OPTIONS", path, "ops")
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)
    settings = Settings(service_token=TOKEN)  # type: ignore[arg-type]
    with live_server(env_app(EnvPool(), settings)) as url:
        r = httpx.request("OPTIONS", f"{url}/envs/x", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers


def test_a_seed_of_false_is_not_the_seed_0(api: dict) -> None:
    r = _call(api, "POST", "/api/runs", "alpha", json={"task": "numberline", "seed": False})
    _refused_422(r, ["seed"])
    settings = Settings(service_token=TOKEN)  # type: ignore[arg-type]
    with live_server(env_app(EnvPool(), settings)) as url:
        body = {"task": "numberline", "seed": False}
        r = httpx.post(f"{url}/envs", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422, r.text
