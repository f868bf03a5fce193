"""The tuning stage (services/study/tuning.py): a bad `[tuning]` section is one line and nothing
runs (CLI and REST), `gtr study plan` shows the trials and their cost, and
configs/studies/demo-tuning.toml tunes GTR's sft_coef on a tuning seed, then runs its grid with
the selected value, and a second `gtr study run` does not tune again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from services.api.app import create_app
from services.api.auth import COOKIE_NAME, create_token
from shared.db.models import Run, Study
from shared.db.session import session_scope
from tests.conftest import free_port, live_server
from tests.e2e.helpers import ROOT
from tests.services.study.tiny_study import gtr_cli

DEMO = ROOT / "configs" / "studies" / "demo-tuning.toml"
BASE = ROOT / "configs" / "numberline-tiny.toml"
STUDY = """
name = "tuned"
seeds = [0, 1]
[tasks.numberline]
config = "{base}"
[arms.gtr]
algorithm = "gtr"
[arms.rl4vlm]
algorithm = "rl4vlm"
[tuning]
trials = 2
seeds = {seeds}
[tuning.arms.{arm}]
{knobs}
"""
BAD = [
    ("[100]", "gtr", "sft_coef = {{ choices = [] }}", "empty search space: choices is empty"),
    ("[100]", "gtr", "lr = {{ low = 0.01, high = 0.001 }}", "empty search space: low 0.01"),
    ("[100]", "gtr", "", "arms.gtr: empty search space (no knob)"),
    ("[1, 100]", "gtr", "lr = {{ choices = [0.001] }}", "tuning.seeds: 1 also evaluation seed"),
    ("[100]", "gtr", "momentum = {{ choices = [0.9] }}", "unknown knob 'momentum'"),
    ("[100]", "rl4vlm", "sft_coef = {{ choices = [1.0] }}", "changes nothing for algorithm"),
    ("[100]", "sft", "lr = {{ choices = [0.001] }}", "'sft' is not an arm of the study"),
]


def _file(tmp_path: Path, seeds: str, arm: str, knobs: str) -> Path:
    path = tmp_path / "tuned.toml"
    body = STUDY.replace("{knobs}", knobs.format()).replace("{arm}", arm)
    path.write_text(body.replace("{base}", str(BASE)).replace("{seeds}", seeds))
    return path


@pytest.mark.parametrize(("seeds", "arm", "knobs", "says"), BAD)
def test_a_bad_tuning_section_is_one_line_and_nothing_runs(
    tmp_path: Path, seeds: str, arm: str, knobs: str, says: str
) -> None:
    path = _file(tmp_path, seeds, arm, knobs)
    env = {"GTR_DATA_DIR": str(tmp_path / "data")}
    out = gtr_cli("study", "run", str(path), env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert sum(says in line for line in out.stderr.splitlines()) == 1
    assert not (tmp_path / "data" / "studies").exists()  # nothing ran
    assert not (tmp_path / "data" / "tuning.sqlite3").exists()


TEAM = "study-tuning"


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[httpx.Client]:
    with session_scope() as s:
        token = create_token(s, f"{TEAM}-write", "write", TEAM)[1]
    with (
        live_server(create_app()) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c,
    ):
        yield c


def _body(tuning: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "tuned over REST",
        "tasks": {"numberline": {"base": {"task": "numberline", "init": {"kind": "none"}}}},
        "arms": {"gtr": {"algorithm": "gtr"}, "rl4vlm": {"algorithm": "rl4vlm"}},
        "seeds": [0, 1],
        "tuning": {"trials": 2, "seeds": [100], **tuning},
    }


@pytest.mark.parametrize(
    ("tuning", "says"),
    [
        ({"arms": {"gtr": {}}}, "empty search space"),
        ({"arms": {"gtr": {"lr": {"choices": [1e-3]}}}, "seeds": [1]}, "also evaluation seed"),
        ({"arms": {"gtr": {"momentum": {"choices": [0.9]}}}}, "unknown knob 'momentum'"),
        ({"arms": {"gtr": {"lr": {"choices": [1e-3, 1e-4]}}}}, "gtr study run"),
    ],
)
def test_rest_refuses_a_tuning_section_in_one_line_and_stores_nothing(
    api: httpx.Client, tuning: dict[str, Any], says: str
) -> None:
    with session_scope() as s:
        before = len(s.scalars(select(Study.id).where(Study.team == TEAM)).all())
    r = api.post("/api/studies", json=_body(tuning))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(says in d["msg"] and "\n" not in d["msg"] for d in detail), detail
    with session_scope() as s:
        assert len(s.scalars(select(Study.id).where(Study.team == TEAM)).all()) == before


def test_the_plan_shows_the_trials_and_the_cost_with_tuning(tmp_path: Path) -> None:
    out = gtr_cli("study", "plan", str(DEMO), env={"GTR_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "study demo-tuning: 1 runs, 16 env steps" in lines[0]
    assert "  gtr: 2 trials x 1 seed(s), 16 env steps a run; sft_coef {0.5, 2.0}" in lines
    assert "cost with the tuning stage: at most 48 env steps" in lines
    assert not (tmp_path / "data" / "tuning.sqlite3").exists()  # the plan writes nothing


@pytest.mark.slow
def test_the_demo_tuning_study_tunes_then_runs_the_grid_with_the_choice(
    tmp_path: Path, default_model_dir: Path
) -> None:
    data = tmp_path / "data"
    env = {
        "GTR_DATA_DIR": str(data),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
        "GTR_DATABASE_URL": None,  # the embedded default
        "GTR_REDIS_URL": None,
    }
    out = gtr_cli("study", "run", str(DEMO), env=env, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tuning gtr trial 0 {'sft_coef': " in out.stdout
    assert "tuning gtr: selected trial" in out.stdout and "study 1 done" in out.stdout
    report = json.loads(gtr_cli("study", "report", "1", "--json", env=env).stdout)
    (arm,) = report["tuning"]
    trials = arm["trials"]
    assert [t["number"] for t in trials] == [0, 1]
    assert sorted(t["params"]["sft_coef"] for t in trials) == [0.5, 2.0]  # the grid, in full
    assert all(t["state"] in ("complete", "pruned") for t in trials)
    complete = [t for t in trials if t["state"] == "complete"]
    best = max(complete, key=lambda t: (t["score"], -t["number"]))
    assert arm["selected_trial"] == best["number"] and arm["selected"] == best["params"]
    for t in trials:
        if t["state"] == "pruned":
            assert t["stopped_at"] is not None and t["stopped_at"] < 2
    url = f"sqlite:///{data / 'gtr.sqlite3'}"
    with session_scope(url) as s:
        runs = s.scalars(select(Run).order_by(Run.id)).all()
        tuning = [r for r in runs if r.study_id is None]
        grid = [r for r in runs if r.study_id == 1]
        assert sorted(r.id for r in tuning) == sorted(x for t in trials for x in t["runs"])
        assert all(r.config["seed"] == 100 for r in tuning)  # a tuning seed, never 0
        (run,) = grid
        assert run.status == "completed" and run.config["seed"] == 0
        chosen = arm["selected"]["sft_coef"]
        assert run.config["train"]["sft_coef"] == chosen  # the grid runs with the choice
        study = s.get(Study, 1)
        assert study is not None and study.spec["arms"]["gtr"]["train"]["sft_coef"] == chosen
    text = gtr_cli("study", "report", "1", "--markdown", env=env).stdout
    assert "### Tuning" in text and "selected trial" in text
    assert text.count("- trial ") == 2
    again = gtr_cli("study", "run", str(DEMO), env=env, timeout=300)  # resumes: no new trial
    assert again.returncode == 0 and "tuning gtr trial" not in again.stdout, again.stdout
    assert "started" not in again.stdout
    with session_scope(url) as s:
        assert len(s.scalars(select(Run.id)).all()) == len(runs)
    _the_page_shows_every_trial_and_the_choice(env, arm)


def _the_page_shows_every_trial_and_the_choice(env: dict[str, str | None], arm: Any) -> None:
    """`gtr serve` on the study's store: the API's report and the study page list the trials."""
    token = gtr_cli("token", "create", "page", "--read-only", env=env).stdout.strip()
    port = free_port()
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    server = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.5)
        with httpx.Client(base_url=url, cookies={COOKIE_NAME: token}, timeout=60) as c:
            api = c.get("/api/studies/1", headers={"Authorization": f"Bearer {token}"})
            assert api.status_code == 200, api.text
            assert api.json()["tuning"][0]["selected"] == arm["selected"]
            page = c.get("/studies/1")
            assert page.status_code == 200, page.text[:500]
        html = page.text
        assert 'id="tuning"' in html and html.count("<tr") >= 2
        for t in arm["trials"]:
            assert f"sft_coef = {t['params']['sft_coef']}" in html
        assert f"selected trial {arm['selected_trial']}" in html
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_the_pruner_stops_a_trial_behind_the_others_and_its_run_ends_cancelled(
    tmp_path: Path, default_model_dir: Path
) -> None:
    # A deterministic curve: each update records its learning rate (`lr`, peak at update 0).
    # Selected by the lowest mean lr, trial 1 (lr 0.01) is behind trial 0's 0.001 at its
    # first report, so the median rule stops it there.
    text = DEMO.read_text().replace('name = "demo-tuning"', 'name = "pruned"')
    text = text.replace('config = "../numberline-tiny.toml"', f'config = "{BASE}"')
    text = text.replace(
        'metric = { metric = "eval/success_rate", reduce = "mean" }',
        'metric = { metric = "lr", reduce = "mean", higher_is_better = false }',
    ).replace("sft_coef = { choices = [0.5, 2.0] }", "lr = { choices = [0.001, 0.01] }")
    path = tmp_path / "pruned.toml"
    path.write_text(text)
    data = tmp_path / "data"
    env = {
        "GTR_DATA_DIR": str(data),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
        "GTR_DATABASE_URL": None,
        "GTR_REDIS_URL": None,
    }
    out = gtr_cli("study", "run", str(path), env=env, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tuning gtr trial 1: pruned at update 0" in out.stdout
    (arm,) = json.loads(gtr_cli("study", "report", "1", "--json", env=env).stdout)["tuning"]
    first, second = arm["trials"]
    assert first["state"] == "complete" and 0 < first["score"] <= 0.001
    assert second["state"] == "pruned" and second["stopped_at"] == 0
    assert arm["selected"] == {"lr": 0.001}
    with session_scope(f"sqlite:///{data / 'gtr.sqlite3'}") as s:
        (stopped,) = [s.get(Run, i) for i in second["runs"]]
        assert stopped is not None and stopped.status == "cancelled"
        assert stopped.updates_done < 2  # stopped before its budget
        (run,) = s.scalars(select(Run).where(Run.study_id == 1)).all()
        assert run.status == "completed" and run.config["train"]["lr"] == 0.001
