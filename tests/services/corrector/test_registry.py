"""The corrector registry over real HTTP: auth, secrets, URL validation, test and stats."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from services.api.auth import create_token
from services.api.routes.correctors import router
from services.corrector.keys import decrypt_key
from shared.db import models
from shared.db.session import session_scope
from shared.settings import Settings, get_settings
from tests.conftest import live_server
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat
from tests.services.corrector.helpers import env_ready, make_step
from tests.services.corrector.test_structure_probe import YES, prose_unless_shown

SECRET = "sk-live-DO-NOT-LEAK-0123456789"
SETTINGS = Settings(corrector_url_allowlist=["127.0.0.1", "api.openai.com"])


def _token(scope: str, team: str = "default") -> dict[str, str]:
    with session_scope() as s:
        return {"Authorization": f"Bearer {create_token(s, f't-{scope}', scope, team)[1]}"}


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[str]:
    app = FastAPI()
    app.include_router(router)
    app.dependency_overrides[get_settings] = lambda: SETTINGS
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def admin(api: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, headers=_token("admin"), timeout=30) as c:
        yield c


def _create(admin: httpx.Client, name: str, **fields: object) -> httpx.Response:
    body = {
        "name": name,
        "kind": "openai",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "gpt-4o",
        **fields,
    }
    return admin.post("/api/correctors", json=body)


def test_auth_scopes(api: str, admin: httpx.Client) -> None:
    assert httpx.get(f"{api}/api/correctors").status_code == 401
    reader = _token("read")
    assert httpx.get(f"{api}/api/correctors", headers=reader).status_code == 200
    denied = httpx.post(
        f"{api}/api/correctors",
        headers=_token("write"),
        json={"name": "w", "kind": "http", "base_url": "http://127.0.0.1:9"},
    )
    assert denied.status_code == 403 and "admin" in denied.json()["detail"]
    assert _create(admin, "scoped").status_code == 201


def test_secret_is_encrypted_and_never_returned_or_logged(
    admin: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = _create(admin, "secretive", api_key=SECRET)
    assert created.status_code == 201, created.text
    out = created.json()
    assert out["api_key_set"] is True and "api_key" not in out
    texts = [
        created.text,
        admin.get("/api/correctors").text,
        admin.get(f"/api/correctors/{out['id']}").text,
    ]
    texts.append(admin.patch(f"/api/correctors/{out['id']}", json={"model": "gpt-4.1"}).text)
    assert all(SECRET not in t for t in texts)
    assert SECRET not in caplog.text
    with session_scope() as s:
        row = s.get(models.Corrector, out["id"])
        assert row is not None and SECRET not in (row.api_key_encrypted or "")
        assert decrypt_key(row, SETTINGS) == SECRET
        assert row.model == "gpt-4.1"


def test_patch_removes_the_key_and_delete(admin: httpx.Client) -> None:
    cid = _create(admin, "short-lived", api_key=SECRET).json()["id"]
    patched = admin.patch(
        f"/api/correctors/{cid}", json={"api_key": "", "api_key_env": "GTR_CORRECTOR_KEY_OPENAI"}
    )
    assert patched.json()["api_key_set"] is False
    assert patched.json()["api_key_env"] == "GTR_CORRECTOR_KEY_OPENAI"
    assert admin.delete(f"/api/correctors/{cid}").status_code == 204
    assert admin.get(f"/api/correctors/{cid}").status_code == 404


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"base_url": "ftp://127.0.0.1/v1"}, "http:// or https://"),
        ({"base_url": "file:///etc/passwd"}, "http:// or https://"),
        ({"base_url": "http://"}, "no host"),
        ({"base_url": "http://user:pw@127.0.0.1/v1"}, "credentials"),
        ({"base_url": "https://evil.example.com/v1"}, "allowlist"),
        ({"base_url": "http://127.0.0.1:99999/v1"}, "valid URL"),
        ({"base_url": None}, "needs a base_url"),
        ({"model": None}, "needs a model"),
        ({"params": {"temperature": 9}}, "params.temperature"),
        ({"params": {"shell": "rm -rf /"}}, "params.shell"),
    ],
)
def test_bad_correctors_are_422(admin: httpx.Client, fields: dict, why: str) -> None:
    response = _create(admin, "bad", **fields)
    assert response.status_code == 422 and why in str(response.json()["detail"]), response.text


def test_bad_names_and_duplicates(admin: httpx.Client) -> None:
    assert _create(admin, "dup").status_code == 201
    again = _create(admin, "dup")
    assert again.status_code == 409 and "exists" in again.json()["detail"]
    assert _create(admin, "oracle").status_code == 409
    assert _create(admin, "has space").status_code == 422


def test_teams_see_their_own_correctors(api: str, admin: httpx.Client) -> None:
    cid = _create(admin, "team-default").json()["id"]
    other = _token("read", team="other")
    assert httpx.get(f"{api}/api/correctors/{cid}", headers=other).status_code == 404
    assert cid not in [c["id"] for c in httpx.get(f"{api}/api/correctors", headers=other).json()]


def test_stats_from_the_corrections_table(admin: httpx.Client) -> None:
    cid = _create(admin, "measured").json()["id"]
    latencies = [100.0, 200.0, 300.0, 400.0]
    with session_scope() as s:
        for i, latency in enumerate(latencies + [None]):
            step = make_step(s, "numberline", {"current": 1, "target": 3}, "{}")
            s.add(
                models.Correction(
                    step_id=step.id,
                    run_id=step.run_id,
                    update_idx=0,
                    corrector="measured",
                    status="done" if latency else "failed",
                    latency_ms=latency,
                    verdict="incorrect" if i % 2 else "correct",
                    tokens=10,
                )
            )
    stats = admin.get(f"/api/correctors/{cid}/stats").json()
    assert stats["done"] == 4 and stats["failed"] == 1 and stats["tokens"] == 50
    assert stats["failure_rate"] == pytest.approx(0.2)
    assert stats["latency_mean_ms"] == pytest.approx(250.0) and stats["latency_p95_ms"] == 400.0
    assert stats["incorrect_rate"] == pytest.approx(0.5)


def test_the_test_endpoint_reports_verdict_or_error(
    admin: httpx.Client, fake_openai: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    env_ready()
    caplog.set_level(logging.DEBUG)
    cid = _create(admin, "tested", base_url=fake_openai.url, api_key=SECRET).json()["id"]
    fake_openai.then(
        chat('{"answer1": "", "answer2": "", "evaluation": "YES", "correction": null}')
    )
    sample = {"task": "numberline", "seed": 3, "probe": False}
    good = admin.post(f"/api/correctors/{cid}/test", json=sample).json()
    assert good["ok"] is True and good["verdict"] == "correct" and good["latency_ms"] > 0
    assert good["structured"] is None and good["probe"] == [] and good["attempts"] == 1
    assert fake_openai.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    fake_openai.default = Reply(500, {"error": {"message": "down"}})
    bad = admin.post(f"/api/correctors/{cid}/test").json()  # probes by default: one probe, down
    assert bad["ok"] is False and "HTTP 500" in bad["error"] and len(fake_openai.requests) == 3
    assert [(p["level"], p["outcome"]) for p in bad["probe"]] == [("json_schema", "failed")]
    assert bad["structured"].endswith("(transport: the endpoint answered HTTP 500); not known")
    assert "down" not in json.dumps(bad)  # categories, never the remote's words
    assert SECRET not in caplog.text
    with session_scope() as s:
        assert s.scalar(select(models.Corrector.id).where(models.Corrector.name == "tested")) == cid


def test_the_test_endpoint_probes_a_server_that_ignores_response_format(
    api: str, admin: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    """The REST test runs the CLI's probe: a server that answers 200 in prose whatever
    ``response_format`` says is reported as ignoring every level, with each answer's reason;
    the sample then carries the schema in its prompt and its JSON is found inside the prose."""
    env_ready()
    fake_openai.respond = prose_unless_shown
    cid = _create(admin, "ignores-format", base_url=fake_openai.url).json()["id"]
    r = admin.post(f"/api/correctors/{cid}/test", json={"task": "numberline", "seed": 1})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["ok"] is True and got["verdict"] == "correct", got
    assert got["attempts"] == 4  # three probes and the sample
    assert [(p["level"], p["outcome"], p["reason"]) for p in got["probe"]] == [
        (level, "ignored", "malformed: answer is not JSON")
        for level in ("json_schema", "json_object_schema", "json_object")
    ]
    assert "the schema is NOT enforced by this server" in got["structured"]
    assert got["raw"].startswith("Sure! Here is my evaluation:")
    assert "Hope this helps." in got["raw"]
    assert "response_format" not in fake_openai.requests[-1]["json"]

    # The same server now judges "NO" without a correction: the reason names the missing part.
    no = {**YES, "evaluation": "NO"}
    fake_openai.respond = lambda body: chat(f"My verdict: {json.dumps(no)} (sorry)")
    bad = admin.post(f"/api/correctors/{cid}/test").json()
    assert bad["ok"] is False
    assert bad["error"] == "malformed: evaluation is NO but 'correction' is no JSON object", bad
    assert bad["raw"].startswith("My verdict:")
    assert [p["reason"] for p in bad["probe"]] == ["malformed: answer is not JSON"] * 3


def test_the_test_endpoint_refuses_what_it_cannot_test(
    api: str, admin: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    cid = _create(admin, "someone-elses", base_url=fake_openai.url).json()["id"]
    other_team = _token("write", team="other")
    theirs = httpx.post(f"{api}/api/correctors/{cid}/test", headers=other_team, timeout=30)
    assert theirs.status_code == 404 and theirs.json()["detail"] == f"corrector {cid} not found"
    missing = admin.post("/api/correctors/987654321/test")
    assert missing.status_code == 404 and "987654321 not found" in missing.json()["detail"]
    reader = httpx.post(f"{api}/api/correctors/{cid}/test", headers=_token("read"), timeout=30)
    assert reader.status_code == 403
    for body, field in (({"task": "chess"}, "task"), ({"probe": "maybe"}, "probe")):
        refused = admin.post(f"/api/correctors/{cid}/test", json=body)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"][-1] == field
    assert fake_openai.requests == []  # nothing was sent for a refused test
