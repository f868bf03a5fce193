"""Security round 2 (issue #16) on the REST API: values that cannot be stored, other teams'
correctors, steps and checkpoints, confined paths, keys and outbound calls, failed-auth limits,
cookie writes from foreign origins, and the server errors found by hand. Real uvicorn server on
PostgreSQL; every refusal is checked to have written nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from services.api.app import create_app
from services.api.auth import create_token
from services.api.middleware import RateLimit
from services.corrector.base import CorrectorError
from services.corrector.service import build_corrector, record_correction
from services.corrector.tasks import correct as correct_task
from shared.db import models
from shared.db.session import session_factory, session_scope
from shared.paths import CHECKPOINT_NOT_FOUND, MODEL_NOT_FOUND
from shared.settings import Settings, get_settings
from tests.conftest import live_server
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat
from tests.services.corrector.helpers import make_step

AGENT = {"thoughts": "go right", "action": "+"}
STATE = {"position": 1, "target": 3}


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict[str, Any]]:
    tokens = {}
    with session_scope() as s:
        for name, scope, team in [
            ("alpha", "write", "alpha"),
            ("alpha-admin", "admin", "alpha"),
            ("beta", "write", "beta"),
            ("ops", "admin", "ops"),
        ]:
            tokens[name] = create_token(s, f"hard-{name}", scope, team)[1]
    with live_server(create_app()) as url:
        yield {"url": url, "tokens": tokens}


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    threading.Thread(target=server.server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def _call(api: dict, method: str, path: str, who: str | None = None, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", {})
    if who:
        headers["Authorization"] = f"Bearer {api['tokens'][who]}"
    return httpx.request(method, api["url"] + path, headers=headers, timeout=60, **kw)


def _count(model: Any) -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def _refused_422(r: httpx.Response, loc: list[str] | None = None, text: str = "") -> str:
    assert r.status_code == 422, (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert isinstance(detail, list) and {"loc", "msg", "type"} <= detail[0].keys(), detail
    if loc is not None:
        assert detail[0]["loc"] == ["body", *loc], detail
    assert text in detail[0]["msg"], detail
    return str(detail[0]["msg"])


# ---- item 2: values that cannot be stored and served back --------------------------------------

NEST = "[" * 300 + "]" * 300
UNSTORABLE = {
    "lone surrogate in env.options": '{"task": "numberline", "env": {"options": {"a": "\\ud800"}}}',
    "lone surrogate in the name": '{"task": "numberline", "name": "bob\\udfff"}',
    "surrogate in an options key": '{"task": "numberline", "env": {"options": {"\\ud800": 1}}}',
    "NaN in env.options": '{"task": "numberline", "env": {"options": {"x": NaN}}}',
    "Infinity in env.options": '{"task": "numberline", "env": {"options": {"x": [Infinity]}}}',
    "-Infinity in train.lr": '{"task": "numberline", "train": {"lr": -Infinity}}',
    "env.options 300 deep": '{"task": "numberline", "env": {"options": {"a": ' + NEST + "}}}",
    "env.options over 64 KiB": '{"task": "numberline", "env": {"options": {"a": "'
    + "x" * 70_000
    + '"}}}',
}


@pytest.mark.parametrize("body", list(UNSTORABLE.values()), ids=list(UNSTORABLE))
def test_unstorable_values_are_refused_before_anything_is_written(api: dict, body: str) -> None:
    before = _count(models.Run)
    r = _call(
        api,
        "POST",
        "/api/runs",
        "alpha",
        content=body,
        headers={"content-type": "application/json"},
    )
    _refused_422(r)
    assert _count(models.Run) == before
    # The team's list still answers: nothing unreadable was stored.
    assert _call(api, "GET", "/api/runs", "alpha").status_code == 200


# ---- item 4: another team's corrector ---------------------------------------------------------


def _launch(api: dict, who: str, **config: Any) -> httpx.Response:
    return _call(api, "POST", "/api/runs", who, json={"name": "h", "task": "numberline", **config})


def test_a_run_may_use_only_its_teams_or_shared_correctors(api: dict) -> None:
    made = _call(api, "POST", "/api/correctors", "ops", json={"name": "ops-only", "kind": "oracle"})
    assert made.status_code == 201 and made.json()["shared"] is False
    before = _count(models.Run)
    for name in ("ops-only", "never-registered"):  # one answer: existence is not confirmed
        msg = _refused_422(_launch(api, "alpha", corrector={"name": name}), ["corrector", "name"])
        assert msg.startswith(f"no corrector named '{name}' is available to team 'alpha'")
    assert _count(models.Run) == before
    cid = made.json()["id"]
    shared = _call(api, "PATCH", f"/api/correctors/{cid}", "ops", json={"shared": True})
    assert shared.status_code == 200 and shared.json()["shared"] is True
    ok = _launch(api, "alpha", corrector={"name": "ops-only"})
    assert ok.status_code == 201, ok.text
    own = _call(
        api, "POST", "/api/correctors", "alpha-admin", json={"name": "a1", "kind": "oracle"}
    )
    assert own.status_code == 201
    assert _launch(api, "alpha", corrector={"name": "a1"}).status_code == 201
    _refused_422(_launch(api, "beta", corrector={"name": "a1"}), ["corrector", "name"])


def test_the_worker_refuses_another_teams_corrector_and_sends_nothing(
    api: dict, fake: FakeOpenAI
) -> None:
    """A run that names another team's corrector (stored before the launch check existed, or
    edited in the database) gets a recorded failure; the corrector's key never leaves."""
    fake.default = chat('{"evaluation": "YES"}')
    with session_scope() as s:
        s.add(
            models.Corrector(
                name="alpha-gpt", kind="openai", base_url=fake.url, model="m", team="alpha"
            )
        )
        run = models.Run(
            name="b", team="beta", task="numberline", algorithm="gtr", total_env_steps=1,
            num_updates=1, config={"task": "numberline", "corrector": {"name": "alpha-gpt"}},
        )  # fmt: skip
        s.add(run)
        s.flush()
        step_id = make_step(s, "numberline", STATE, AGENT, run=run).id
    assert correct_task(step_id, "alpha-gpt")["status"] == "failed"
    with session_scope() as s:
        row = s.scalar(select(models.Correction).where(models.Correction.step_id == step_id))
        assert row is not None and row.error == (
            "config: corrector 'alpha-gpt' is not available to team 'beta'"
        )
        with pytest.raises(CorrectorError, match="not available"):
            build_corrector("alpha-gpt", s, get_settings(), team="beta")
    assert fake.requests == []


# ---- item 5: model and checkpoint paths --------------------------------------------------------


def _checkpoint_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "policy.json").write_text("{}")
    return root


def test_checkpoint_and_model_paths_are_confined_with_one_answer(api: dict, data_dir: Path) -> None:
    beta = _launch(api, "beta").json()["id"]
    alpha = _launch(api, "alpha").json()["id"]
    store = get_settings().checkpoints_path
    theirs = _checkpoint_dir(store / f"run-{beta}" / "update-0")
    ours = _checkpoint_dir(store / f"run-{alpha}" / "update-0")
    before = _count(models.Run)
    for path in [
        "/etc",  # exists, outside every root
        "/nonexistent/ckpt",
        str(store / ".." / ".." / ".." / ".." / "etc"),
        f"run-{beta}/update-0/../../../../../etc",
        str(theirs),  # another team's, by path
        f"run-{beta}/update-0",  # ... and by id
        "c" * 1000,  # a name too long for the file system: was a 500
        f"run-{alpha}/update-9",
    ]:
        r = _launch(api, "alpha", init={"kind": "checkpoint", "checkpoint": path})
        _refused_422(r, ["init", "checkpoint"], CHECKPOINT_NOT_FOUND)
    for path in ["/etc", "/usr/lib", str(data_dir / "models" / ".." / "..")]:
        _refused_422(
            _launch(api, "alpha", model={"path": path}), ["model", "path"], MODEL_NOT_FOUND
        )
    assert _count(models.Run) == before
    by_id = _launch(
        api, "alpha", init={"kind": "checkpoint", "checkpoint": f"run-{alpha}/update-0"}
    )
    assert by_id.status_code == 201, by_id.text
    with session_scope() as s:  # stored resolved: the trainer never sees a relative path
        run = s.get(models.Run, by_id.json()["id"])
        assert run is not None and run.config["init"]["checkpoint"] == str(ours.resolve())


# ---- item 6: keys, outbound calls, error texts -------------------------------------------------


def test_api_key_env_only_under_the_documented_prefix(api: dict) -> None:
    before = _count(models.Corrector)
    body = {"name": "leaky", "kind": "openai", "base_url": "https://api.example.com/v1"}
    for var in ("GTR_DATABASE_URL", "GTR_SECRET_KEY", "HOME", "gtr_corrector_key_x"):
        r = _call(
            api, "POST", "/api/correctors", "ops", json={**body, "model": "m", "api_key_env": var}
        )
        _refused_422(r, ["api_key_env"])
    assert _count(models.Corrector) == before
    ok = {**body, "model": "m", "api_key_env": "GTR_CORRECTOR_KEY_EXAMPLE"}
    made = _call(api, "POST", "/api/correctors", "ops", json=ok)
    assert made.status_code == 201, made.text
    cid = made.json()["id"]
    r = _call(
        api, "PATCH", f"/api/correctors/{cid}", "ops", json={"api_key_env": "GTR_DATABASE_URL"}
    )
    assert r.status_code == 422
    with session_scope() as s:
        row = s.get(models.Corrector, cid)
        assert row is not None and row.api_key_env == "GTR_CORRECTOR_KEY_EXAMPLE"


def test_corrector_calls_refuse_internal_addresses_after_resolution(
    api: dict, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.default = chat('{"evaluation": "YES"}')
    port = fake.server.server_address[1]
    urls = [
        fake.url,  # loopback
        f"http://localhost:{port}/v1",  # a name that resolves to loopback
        f"http://2130706433:{port}/v1",  # 127.0.0.1, decimal-encoded
        f"http://[::1]:{port}/v1",
        f"http://[::ffff:127.0.0.1]:{port}/v1",
        "http://169.254.169.254/latest/v1",  # cloud metadata
        "http://10.0.0.1:8000/v1",
        "http://0.0.0.0:9/v1",
    ]
    # Registered while private networks were allowed (the tests' setting), then the operator
    # turns them off: every call is checked again after resolution, whatever was registered.
    ids = []
    for i, url in enumerate(urls):
        body = {"name": f"inner-{i}", "kind": "openai", "base_url": url, "model": "m"}
        made = _call(api, "POST", "/api/correctors", "ops", json=body)
        assert made.status_code == 201, made.text
        ids.append(made.json()["id"])
    monkeypatch.setenv("GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS", "false")
    get_settings.cache_clear()
    try:
        for url, cid in zip(urls, ids, strict=True):
            r = _call(api, "POST", f"/api/correctors/{cid}/test", "ops")
            assert r.status_code == 200 and r.json()["ok"] is False, (url, r.text)
            assert "loopback, private, link-local or reserved" in r.json()["error"], (url, r.text)
            # And a new registration of the same address is refused at once, in one line.
            body = {"name": f"again-{cid}", "kind": "openai", "base_url": url, "model": "m"}
            again = _call(api, "POST", "/api/correctors", "ops", json=body)
            assert again.status_code == 422, (url, again.text)
            assert "loopback, private, link-local or reserved" in again.json()["detail"]
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert fake.requests == []


def test_test_errors_are_categories_and_stored_errors_hold_no_remote_text(
    api: dict, fake: FakeOpenAI, db: Any
) -> None:
    echo = {"error": {"message": "Authorization: Bearer sk-live-ECHOED-9f8e header rejected"}}
    fake.default = Reply(401, echo)
    body = {"name": "echoer", "kind": "openai", "base_url": fake.url, "model": "m"}
    made = _call(
        api, "POST", "/api/correctors", "ops", json={**body, "api_key": "sk-live-ECHOED-9f8e"}
    )
    r = _call(api, "POST", f"/api/correctors/{made.json()['id']}/test", "ops")
    assert r.json() == {
        **r.json(),
        "ok": False,
        "error": "transport: the endpoint answered HTTP 401",
    }
    closed = {**body, "name": "closed-port", "base_url": "http://127.0.0.1:9/v1"}
    made = _call(api, "POST", "/api/correctors", "ops", json=closed)
    r = _call(api, "POST", f"/api/correctors/{made.json()['id']}/test", "ops")
    assert r.json()["error"] == (
        "transport: the endpoint could not be reached (refused, reset or timed out)"
    )
    step = make_step(db, "numberline", STATE, AGENT)
    corrector = build_corrector("echoer", db, get_settings())
    row = record_correction(db, step.id, "echoer", corrector)
    assert row.status == "failed" and row.error is not None and "HTTP 401" in row.error
    assert "ECHOED" not in row.error and "Bearer" not in row.error, row.error


# ---- item 7: failed authentication and /login are limited per address -------------------------


def test_failed_authentication_is_limited_per_address(api: dict) -> None:
    app = create_app(Settings(api_rate_limit_per_minute=600, auth_failures_per_minute=5))
    with live_server(app) as url:
        codes = [
            httpx.get(f"{url}/api/me", headers={"Authorization": f"Bearer wrong-{i}"}).status_code
            for i in range(7)
        ]
        assert codes == [401] * 5 + [429] * 2
        # The address is limited now, whatever it sends: a brute force learns nothing more.
        right = httpx.get(
            f"{url}/api/me", headers={"Authorization": f"Bearer {api['tokens']['alpha']}"}
        )
        assert right.status_code == 429 and 0 < int(right.headers["Retry-After"]) <= 61
    with live_server(create_app(Settings(auth_failures_per_minute=3))) as url:
        logins = [
            httpx.post(f"{url}/login", data={"token": f"nope-{i}"}).status_code for i in range(5)
        ]
        assert logins == [401] * 3 + [429] * 2


def test_the_limiter_tables_stay_bounded() -> None:
    limiter = RateLimit(lambda *a: None, per_minute=10, failures_per_minute=5, max_keys=100)
    now = time.monotonic()
    for i in range(5_000):
        limiter._window(limiter.hits, f"token-{i}", now).append(now)
        limiter._window(limiter.failures, f"10.0.{i // 256}.{i % 256}", now).append(now)
    assert len(limiter.hits) == len(limiter.failures) == 100
    assert "token-4999" in limiter.hits and "token-0" not in limiter.hits


# ---- item 8: server errors found by hand -------------------------------------------------------


def test_the_server_errors_found_by_hand_are_4xx_with_a_message(api: dict) -> None:
    made = _call(api, "POST", "/api/correctors", "ops", json={"name": "orc-alf", "kind": "oracle"})
    cid = made.json()["id"]
    r = _call(api, "POST", f"/api/correctors/{cid}/test", "ops", json={"task": "alfworld"})
    assert r.status_code in (200, 422), r.text  # 200 where ALFWorld's games are installed
    if r.status_code == 422:
        assert "alfworld" in r.json()["detail"]
    before = _count(models.Corrector)
    for key in ("ключ-sk-123", "sk 123", "sk-\n-x"):
        body = {"name": "k", "kind": "openai", "base_url": "https://a.example/v1", "model": "m"}
        _refused_422(_call(api, "POST", "/api/correctors", "ops", json={**body, "api_key": key}))
    assert _count(models.Corrector) == before


def test_patch_racing_delete_answers_404_not_500(api: dict) -> None:
    made = _call(api, "POST", "/api/correctors", "ops", json={"name": "racer", "kind": "oracle"})
    cid = made.json()["id"]
    deleter = session_factory()()
    row = deleter.get(models.Corrector, cid)
    deleter.delete(row)
    deleter.flush()  # the row is locked and gone for everyone once this commits
    answer: dict[str, httpx.Response] = {}
    patch = threading.Thread(
        target=lambda: answer.update(
            r=_call(api, "PATCH", f"/api/correctors/{cid}", "ops", json={"params": {"noise": 0.1}})
        )
    )
    patch.start()
    time.sleep(1.0)  # the PATCH has read the row and now waits on the lock
    deleter.commit()
    deleter.close()
    patch.join(30)
    assert answer["r"].status_code == 404, answer["r"].text
    assert answer["r"].json()["detail"] == f"corrector {cid} not found"


# ---- item 9: leaks and checks ------------------------------------------------------------------


def test_another_teams_step_and_episode_answer_like_missing_ones(api: dict) -> None:
    with session_scope() as s:
        run = models.Run(
            name="a", team="alpha", task="numberline", algorithm="gtr", config={},
            total_env_steps=1, num_updates=1,
        )  # fmt: skip
        s.add(run)
        s.flush()
        step = make_step(s, "numberline", STATE, AGENT, run=run)
        step_id, episode_id = step.id, step.episode_id
    assert _call(api, "GET", f"/api/steps/{step_id}", "alpha").status_code == 200
    for path, missing in [
        (f"/api/steps/{step_id}", "/api/steps/2000000000"),
        (f"/api/episodes/{episode_id}/steps", "/api/episodes/2000000000/steps"),
    ]:
        theirs, absent = _call(api, "GET", path, "beta"), _call(api, "GET", missing, "beta")
        assert theirs.status_code == absent.status_code == 404
        id_of = path.split("/")[3]
        assert theirs.json()["detail"] == absent.json()["detail"].replace("2000000000", id_of)


def test_cookie_writes_from_a_foreign_origin_are_refused(api: dict) -> None:
    cookie = {"gtr_token": api["tokens"]["alpha"]}
    body = {"name": "csrf", "task": "numberline"}
    before = _count(models.Run)
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.post(f"{api['url']}/api/runs", json=body, cookies=cookie, headers=headers)
        assert r.status_code == 403 and "cross-origin" in r.json()["detail"], r.text
    assert _count(models.Run) == before
    same = httpx.post(
        f"{api['url']}/api/runs", json=body, cookies=cookie, headers={"Origin": api["url"]}
    )
    assert same.status_code == 201, same.text
    # A bearer token is not sent by a browser on its own: its Origin does not matter.
    bearer = _call(
        api, "POST", "/api/runs", "alpha", json=body, headers={"Origin": "https://x.example"}
    )
    assert bearer.status_code == 201


@pytest.mark.parametrize(
    "environment, secret, token, ok",
    [
        ("Production", "x", "t" * 40, False),  # any case counts as production
        (" PRODUCTION ", "s" * 40, "t" * 40, True),
        ("prod", "s" * 40, None, False),  # no service token
        ("production", "s" * 31, "t" * 40, False),  # too short
        ("production", "s" * 40, "t" * 5, False),
        ("production", "s" * 40, "dev-insecure-service-token-change-me", False),
        ("development", "x", None, True),
    ],
)
def test_the_production_check(environment: str, secret: str, token: str | None, ok: bool) -> None:
    def make() -> Settings:
        return Settings(environment=environment, secret_key=secret, service_token=token)  # type: ignore[arg-type]

    if ok:
        assert make().environment == environment
    else:
        with pytest.raises(ValueError, match="must be set"):
            make()
