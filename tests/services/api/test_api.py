from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func, select

from services.api.app import create_app
from services.api.auth import create_token, revoke_token
from shared.db.models import Run
from shared.db.session import session_scope
from tests.conftest import live_server

CONFIG = {
    "name": "nl",
    "task": "numberline",
    "algorithm": "gtr",
    "train": {"num_envs": 2, "num_steps": 4, "num_updates": 3},
}


def _token(scope: str = "write", team: str = "default") -> str:
    with session_scope() as s:
        return create_token(s, f"t-{scope}", scope, team)[1]


@pytest.fixture(scope="module")
def base_url(pg_url: str) -> Iterator[str]:
    with live_server(create_app()) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {_token()}"}, timeout=30
    ) as c:
        yield c


def _count_runs() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Run)) or 0


def test_health_and_docs(base_url: str) -> None:
    assert httpx.get(f"{base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
    assert "swagger" in httpx.get(f"{base_url}/docs").text.lower()
    assert "/api/runs" in httpx.get(f"{base_url}/openapi.json").json()["paths"]


def test_create_list_get_cancel(client: httpx.Client) -> None:
    created = client.post("/api/runs", json=CONFIG)
    assert created.status_code == 201, created.text
    run = created.json()
    assert run["status"] == "queued" and run["total_env_steps"] == 24 and run["num_updates"] == 3
    assert run["config"]["train"]["num_envs"] == 2 and run["config"]["train"]["clip"] == 0.2
    assert client.get(f"/api/runs/{run['id']}").json()["name"] == "nl"
    listed = client.get("/api/runs", params={"status": "queued"}).json()
    assert run["id"] in [r["id"] for r in listed["items"]]
    cancelled = client.post(f"/api/runs/{run['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    again = client.post(f"/api/runs/{run['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]


def test_resume_a_failed_run(base_url: str, client: httpx.Client) -> None:
    run = client.post("/api/runs", json=CONFIG).json()
    refused = client.post(f"/api/runs/{run['id']}/resume")
    assert (
        refused.status_code == 409 and "only a failed or cancelled run" in refused.json()["detail"]
    )
    with session_scope() as s:
        row = s.get(Run, run["id"])
        assert row is not None
        row.status, row.error = "failed", "ConnectError: the env service went away"
    reader = {"Authorization": f"Bearer {_token('read')}"}
    other = {"Authorization": f"Bearer {_token('write', 'team-c')}"}
    assert httpx.post(f"{base_url}/api/runs/{run['id']}/resume", headers=reader).status_code == 403
    assert httpx.post(f"{base_url}/api/runs/{run['id']}/resume", headers=other).status_code == 404
    resumed = client.post(f"/api/runs/{run['id']}/resume").json()
    assert resumed["status"] == "queued" and resumed["finished_at"] is None


def test_pagination(client: httpx.Client) -> None:
    for i in range(5):
        assert client.post("/api/runs", json={**CONFIG, "name": f"page-{i}"}).status_code == 201
    first = client.get("/api/runs", params={"limit": 2, "offset": 0}).json()
    second = client.get("/api/runs", params={"limit": 2, "offset": 2}).json()
    assert len(first["items"]) == 2 and len(second["items"]) == 2 and first["total"] >= 5
    assert not {r["id"] for r in first["items"]} & {r["id"] for r in second["items"]}
    assert client.get("/api/runs", params={"limit": 0}).status_code == 422


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/999999",
        "/api/runs/999999/updates",
        "/api/episodes/999999/steps",
        "/api/steps/999999",
    ],
)
def test_unknown_ids_are_404(client: httpx.Client, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404 and "not found" in r.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**CONFIG, "task": "chess"}, "task"),
        ({**CONFIG, "train": {"num_envs": -1}}, "num_envs"),
        ({**CONFIG, "train": {"num_updates": 10**9}}, "num_updates"),
        ({**CONFIG, "name": "x" * 5000}, "name"),
        ({**CONFIG, "train": {"lr": "fast"}}, "lr"),
        ({**CONFIG, "bogus": 1}, "bogus"),
        ({k: v for k, v in CONFIG.items() if k != "task"}, "task"),
    ],
)
def test_bad_configs_name_the_field_and_write_nothing(
    client: httpx.Client, body: dict, field: str
) -> None:
    before = _count_runs()
    r = client.post("/api/runs", json=body)
    assert r.status_code == 422
    assert any(field in [str(p) for p in e["loc"]] for e in r.json()["detail"]), r.text
    assert _count_runs() == before


def test_malformed_json_and_wrong_types(client: httpx.Client) -> None:
    r = client.post("/api/runs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "json" in r.text.lower()
    assert client.post("/api/runs", json=[1, 2]).status_code == 422
    assert client.get("/api/runs/abc").status_code == 422
    assert client.get("/api/blobs/..%2F..%2Fetc%2Fpasswd").status_code in (400, 404)
    assert client.get("/api/blobs/" + "z" * 64).status_code == 400


def test_auth(base_url: str) -> None:
    r = httpx.post(f"{base_url}/api/runs", json=CONFIG)
    assert r.status_code == 401 and "token" in r.json()["detail"]
    bad = httpx.get(f"{base_url}/api/runs", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    reader = {"Authorization": f"Bearer {_token('read')}"}
    assert httpx.get(f"{base_url}/api/runs", headers=reader).status_code == 200
    denied = httpx.post(f"{base_url}/api/runs", json=CONFIG, headers=reader)
    assert denied.status_code == 403 and "read-only" in denied.json()["detail"]
    with session_scope() as s:
        row, raw = create_token(s, "soon-revoked")
    assert (
        httpx.get(f"{base_url}/api/runs", headers={"Authorization": f"Bearer {raw}"}).status_code
        == 200
    )
    with session_scope() as s:
        revoke_token(s, row.id)
    assert (
        httpx.get(f"{base_url}/api/runs", headers={"Authorization": f"Bearer {raw}"}).status_code
        == 401
    )


def test_teams_do_not_see_each_other(base_url: str) -> None:
    a = {"Authorization": f"Bearer {_token('write', 'team-a')}"}
    b = {"Authorization": f"Bearer {_token('write', 'team-b')}"}
    run = httpx.post(f"{base_url}/api/runs", json=CONFIG, headers=a).json()
    assert httpx.get(f"{base_url}/api/runs/{run['id']}", headers=b).status_code == 404
    assert httpx.post(f"{base_url}/api/runs/{run['id']}/cancel", headers=b).status_code == 404
    assert run["id"] not in [
        r["id"] for r in httpx.get(f"{base_url}/api/runs", headers=b).json()["items"]
    ]


def test_security_headers(base_url: str) -> None:
    r = httpx.get(f"{base_url}/healthz")
    assert (
        r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    )


def test_grpo_and_self_teacher_configs_over_rest(client: httpx.Client) -> None:
    ok = {
        **CONFIG,
        "algorithm": "gtr_grpo",
        "train": {**CONFIG["train"], "group_size": 2},
        "corrector": {"backend": "self_teacher"},
    }
    r = client.post("/api/runs", json=ok)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["corrector"]["name"] == "self_teacher"
    before = _count_runs()
    for body, words in (
        (
            {**CONFIG, "algorithm": "grpo", "train": {**CONFIG["train"], "group_size": 4}},
            "group_size",
        ),
        (
            {**CONFIG, "corrector": {"backend": "self_teacher", "name": "<script>gpt"}},
            "self_teacher",
        ),
        ({**CONFIG, "teacher": {"density": 0}}, "density"),
    ):
        r = client.post("/api/runs", json=body)
        assert r.status_code == 422 and words in r.text, r.text
    assert _count_runs() == before


def test_corrector_cost_on_the_run_and_its_page(client: httpx.Client) -> None:
    from services.corrector.spend import RunBudget
    from shared.db.session import get_engine

    run = client.post("/api/runs", json=CONFIG).json()
    assert run["corrector_cost"] == {"calls": 0, "tokens": 0, "seconds": 0.0}
    budget = RunBudget(get_engine(), run["id"], "gpt-4o", None, None)  # what a paid call writes
    budget.charge_call()
    budget.charge_call()
    budget.add_tokens(1234)
    assert client.get(f"/api/runs/{run['id']}").json()["corrector_cost"]["calls"] == 2
    page = client.get(f"/runs/{run['id']}").text
    assert '<b data-field="corrector-calls">2 API calls</b>' in page and "1234 tokens" in page
    # A run that sends nothing to a corrector shows no cost at all.
    plain = client.post("/api/runs", json={**CONFIG, "algorithm": "rl4vlm"}).json()
    assert plain["corrector_cost"] is None
    assert 'id="corrector-cost"' not in client.get(f"/runs/{plain['id']}").text
