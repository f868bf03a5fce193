"""POST/GET/PUT /api/studies and the scheduler behind them: validation, the concurrency limit,
team scoping, the frozen primary metric, the one retry, cancel and resume, hostile names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from services.api.app import create_app
from services.api.auth import create_token
from services.controller.loop import fail_run
from services.study import service
from shared.db.models import Run, Study
from shared.db.session import session_scope
from tests.conftest import live_server

TEAM = "study-api"
BASE = {
    "task": "numberline",
    "init": {"kind": "none"},
    "train": {"num_envs": 2, "num_steps": 2, "num_updates": 1},
}
HOSTILE = "<script>alert('x')</script> \"q\" & 'r'"


def study(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "api study",
        "tasks": {"numberline": {"base": BASE}},
        "arms": {"gtr": {"algorithm": "gtr"}, "rl4vlm": {"algorithm": "rl4vlm"}},
        "seeds": [0, 1, 2],
        "eval_episodes": 4,
        "concurrency": 2,
    }
    return {**body, **changes}


def _headers(team: str, scope: str = "write") -> dict[str, str]:
    with session_scope() as s:
        return {"Authorization": f"Bearer {create_token(s, f'{team}-{scope}', scope, team)[1]}"}


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[httpx.Client]:
    with (
        live_server(create_app()) as url,
        httpx.Client(base_url=url, headers=_headers(TEAM), timeout=30) as client,
    ):
        yield client
    # No queued run or study of this file may reach another file's controller.
    with session_scope() as s:
        ids = s.scalars(select(Study.id).where(Study.team.in_((TEAM, "study-other")))).all()
        s.execute(update(Study).where(Study.id.in_(ids)).values(status="cancelled"))
        s.execute(
            update(Run)
            .where(Run.study_id.in_(ids), Run.status.in_(("queued", "running")))
            .values(status="cancelled")
        )


def _studies() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Study)) or 0


@pytest.mark.parametrize(
    ("changes", "where", "says"),
    [
        ({"seeds": []}, "seeds", "at least 1"),
        ({"seeds": [1, 1]}, "seeds", "seeds repeat"),
        ({"sedes": [1]}, "sedes", "Extra inputs"),
        (
            {"arms": {"big": {"train": {"num_envs": 0}}}},
            "body",
            "arm 'big', seed 0: train.num_envs",
        ),
        ({"primary": {"metric": "eval success"}}, "primary", "should match pattern"),
        ({"primary": {"metric": "x", "reduce": "best"}}, "reduce", "'last_k_mean' or 'mean'"),
        ({"tasks": {"t": {"config": "/etc/passwd"}}}, "body", "read only by the CLI"),
        ({"arms": {" ": {}}}, "arms", "must not be blank"),
        ({"budget": {"updates": 5, "max_env_steps": 10}}, "body", "budget.max_env_steps"),
        ({"eval_episodes": 0}, "eval_episodes", "greater than or equal to 1"),
        ({"shared_arms": ["nope"]}, "body", "shared_arms: 'nope' is not an arm of the study"),
        ({"tasks": {"numberline": {"base": BASE, "seeds": [1, 1]}}}, "seeds", "seeds repeat"),
    ],
)
def test_a_bad_study_is_a_422_naming_the_field_and_stores_nothing(
    api: httpx.Client, changes: dict[str, Any], where: str, says: str
) -> None:
    before = _studies()
    r = api.post("/api/studies", json=study(**changes))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(where in map(str, d["loc"]) and says in d["msg"] for d in detail), detail
    assert _studies() == before


def test_runs_are_queued_up_to_the_concurrency_and_the_study_is_team_scoped(
    api: httpx.Client,
) -> None:
    r = api.post("/api/studies", json=study(concurrency=2))
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["status"] == "queued" and out["primary_metric"] == "eval/success_rate"
    assert out["counts"] == {
        "cells": 6,
        "waiting": 4,
        "queued": 2,
        "running": 0,
        "done": 0,
        "failed": 0,
        "cancelled": 0,
    }
    with session_scope() as s:
        runs = s.scalars(select(Run).where(Run.study_id == out["id"])).all()
        assert len(runs) == 2 and {r.team for r in runs} == {TEAM}
        assert {(r.study_arm, r.study_seed, r.study_attempt) for r in runs} == {
            ("gtr", 0, 1),
            ("rl4vlm", 0, 1),
        }
        assert all(r.config["metrics"]["eval_episodes"] == 4 for r in runs)
    report = api.get(f"/api/studies/{out['id']}")
    assert report.status_code == 200 and report.json()["name"] == "api study"
    other = _headers("study-other", "read")
    assert api.get(f"/api/studies/{out['id']}", headers=other).status_code == 404
    assert (
        api.post(f"/api/studies/{out['id']}/cancel", headers=_headers("study-other")).status_code
        == 404
    )
    listed = api.get("/api/studies", headers=other).json()
    assert out["id"] not in [x["id"] for x in listed["items"]]
    assert out["id"] in [x["id"] for x in api.get("/api/studies").json()["items"]]
    read_only = _headers(TEAM, "read")
    assert api.post("/api/studies", json=study(), headers=read_only).status_code == 403


def test_the_primary_metric_is_frozen_once_the_study_has_runs(api: httpx.Client) -> None:
    out = api.post("/api/studies", json=study(name="frozen")).json()
    changed = study(name="frozen", primary={"metric": "probe_relevance"})
    r = api.put(f"/api/studies/{out['id']}", json=changed)
    assert r.status_code == 409
    assert "primary metric is eval/success_rate (final)" in r.json()["detail"]
    assert "cannot become probe_relevance (final)" in r.json()["detail"]
    more = api.put(f"/api/studies/{out['id']}", json=study(name="frozen", seeds=[0, 1, 2, 3]))
    assert more.status_code == 200 and more.json()["counts"]["cells"] == 8


def test_a_failed_run_is_retried_once_then_shown_failed(api: httpx.Client) -> None:
    out = api.post("/api/studies", json=study(name="retry", seeds=[5], concurrency=4)).json()
    sid = out["id"]

    def runs() -> list[tuple[str, int, str]]:
        with session_scope() as s:
            rows = s.scalars(select(Run).where(Run.study_id == sid).order_by(Run.id)).all()
            return [(r.study_arm or "", r.study_attempt or 0, r.status) for r in rows]

    first = runs()
    assert [(a, n) for a, n, _ in first] == [("gtr", 1), ("rl4vlm", 1)]
    with session_scope() as s:
        gtr = s.scalar(select(Run.id).where(Run.study_id == sid, Run.study_arm == "gtr"))
    fail_run(int(gtr or 0), "ConnectError: the env service went away")
    with session_scope() as s:
        row = s.get(Study, sid)
        assert row is not None
        retried = service.advance(s, row)
    assert [(r.study_arm, r.study_attempt) for r in retried] == [("gtr", 2)]
    fail_run(retried[0].id, "ConnectError: again")
    with session_scope() as s:
        row = s.get(Study, sid)
        assert row is not None
        assert service.advance(s, row) == []  # no third attempt
        counts = service.plan(s, row).counts()
    assert counts["failed"] == 1 and counts["queued"] == 1 and counts["waiting"] == 0
    assert [(a, n, st) for a, n, st in runs()] == [
        ("gtr", 1, "failed"),
        ("rl4vlm", 1, "queued"),
        ("gtr", 2, "failed"),
    ]


def test_cancel_then_resume_requeues_the_same_runs(api: httpx.Client) -> None:
    out = api.post("/api/studies", json=study(name="stop")).json()
    sid = out["id"]
    cancelled = api.post(f"/api/studies/{sid}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["counts"]["cancelled"] == 2
    again = api.post(f"/api/studies/{sid}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    with session_scope() as s:
        row = s.get(Study, sid)
        assert row is not None and service.advance(s, row) == []  # a cancelled study queues none
        before = {r.id for r in service.study_runs(s, sid)}
    resumed = api.post(f"/api/studies/{sid}/resume").json()
    assert resumed["status"] in ("queued", "running") and resumed["counts"]["queued"] == 2
    with session_scope() as s:
        assert {r.id for r in service.study_runs(s, sid)} == before  # resumed, not new runs
    assert api.post(f"/api/studies/{sid}/resume").status_code == 409


def test_hostile_names_are_stored_and_served_verbatim(api: httpx.Client) -> None:
    body = study(name=HOSTILE, arms={HOSTILE: {"algorithm": "gtr"}, "b\"'": {}}, seeds=[3])
    r = api.post("/api/studies", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == HOSTILE
    listed = api.get("/api/studies").json()["items"]
    assert HOSTILE in [x["name"] for x in listed]
    with session_scope() as s:
        arms = set(s.scalars(select(Run.study_arm).where(Run.study_id == r.json()["id"])))
        names = set(s.scalars(select(Run.name).where(Run.study_id == r.json()["id"])))
    assert arms == {HOSTILE, "b\"'"}
    assert any(HOSTILE in n for n in names)
    control = api.post("/api/studies", json=study(arms={"a\x00b": {}}))
    assert control.status_code == 422
