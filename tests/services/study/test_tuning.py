"""The tuning stage (services/study/tuning.py): a bad `[tuning]` section is one line and nothing
runs (CLI and REST), `gtr study plan` shows configs/studies/demo.toml's trials and their cost
(tests/services/study/test_study_cli.py runs that study); a tuned study run by `gtr study run`
(embedded) tunes on a tuning seed, prunes a trial behind the other, runs its grid with the
choice and does not tune again when run again; a
study posted through REST tunes through a real `gtr controller` (PostgreSQL), killed and
restarted mid-trial, and the report and the study page show the trials and the choice.

Both studies select by a deterministic curve, each update's recorded learning rate (`lr`, its
peak at update 0; lower is better), over lr in {0.001, 0.01}: trial 0 (0.001) completes, trial 1
(0.01) is behind it at its first report, so the median rule stops it there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from services.api.app import create_app
from services.api.auth import COOKIE_NAME, create_token
from services.study import service, tuning
from services.study.runner import seconds_needed
from services.study.schemas import KnobSpec, StudyConfig
from shared.db.models import Run, Study
from shared.db.session import session_scope
from shared.schemas import RunConfig
from tests.conftest import live_server
from tests.e2e.helpers import ROOT, cancel_active_runs, tiny_run
from tests.services.study.tiny_study import gtr_cli, tiny_numberline

DEMO = ROOT / "configs" / "studies" / "demo.toml"
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
    assert "study demo: 4 runs, 96 env steps" in lines[0]
    assert "  gtr: 2 trials x 1 seed(s), 16 env steps a run; sft_coef {0.5, 2.0}" in lines
    assert "cost with the tuning stage: at most 128 env steps" in lines
    # Seeds 0 and 1 of the grid, and the tuning seed's own.
    assert any(line.startswith("warm starts to build: 3 ") for line in lines), lines
    assert not (tmp_path / "data" / "tuning.sqlite3").exists()  # the plan writes nothing


EMBEDDED_BUDGET = 8  # updates a trial run of the embedded study may train


def _lr_study(name: str) -> str:
    """The smallest tuned study (tuning seed 100, grid sampler, median pruner), selecting by the
    recorded lr over lr in {0.001, 0.01}, from no warm start with short episodes (an untrained
    policy's are all truncations: 3 steps of 24 tokens keep its evaluations short)."""
    task = tiny_numberline(probe_states=4, eval_every=1)
    return LR_STUDY.format(name=name, task=task, budget=EMBEDDED_BUDGET)


# 8 updates a trial run: a stop decided at update 0 reaches the run's driver (the runner polls
# each second) long before its budget, on an idle host too, where a tiny update takes about a
# second (at 3, an idle CI host's stopped run finished its budget first).
LR_STUDY = """
name = "{name}"
seeds = [0]
eval_episodes = 4
concurrency = 1
primary = {{ metric = "eval/success_rate", reduce = "final" }}
[budget]
updates = 2
{task}
[arms.gtr]
algorithm = "gtr"
[tuning]
trials = 2
seeds = [100]
updates = {budget}
sampler = "grid"
pruner = "median"
metric = {{ metric = "lr", reduce = "mean", higher_is_better = false }}
[tuning.arms.gtr]
lr = {{ choices = [0.001, 0.01] }}
"""


@dataclass
class Embedded:
    env: dict[str, str | None]
    out: subprocess.CompletedProcess[str]
    url: str  # the store's


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Embedded:
    """`gtr study run` of the lr study on the embedded default (SQLite), in a data folder of its
    own: its tuning stage and its grid of one run."""
    folder = tmp_path_factory.mktemp("tuning-embedded")
    path = folder / "pruned.toml"
    path.write_text(_lr_study("pruned"))
    env: dict[str, str | None] = {
        "GTR_DATA_DIR": str(folder / "data"),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
        "GTR_DATABASE_URL": None,  # the embedded default
        "GTR_REDIS_URL": None,
    }
    out = gtr_cli("study", "run", str(path), env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return Embedded(env, out, f"sqlite:///{folder / 'data' / 'gtr.sqlite3'}")


def _check_stage(
    arm: dict[str, Any], runs: list[Run], grid: Run, team: str, seed: int, budget: int
) -> None:
    """What both ways of running a study must show: every trial of the grid sampler, trial 1
    stopped at its first report with its run cancelled before its budget, trial 0 selected, its
    runs on the tuning seed, and the grid's run on its evaluation seed with the choice."""
    first, second = arm["trials"]
    assert [first["number"], second["number"]] == [0, 1]
    assert [first["params"], second["params"]] == [{"lr": 0.001}, {"lr": 0.01}]
    assert first["state"] == "complete" and 0 < first["score"] <= 0.001
    assert second["state"] == "pruned" and second["stopped_at"] == 0
    assert arm["selected"] == {"lr": 0.001} and arm["selected_trial"] == 0
    by_id = {r.id: r for r in runs}
    assert sorted(by_id) == sorted(first["runs"] + second["runs"])
    assert all(r.config["seed"] == 100 and r.team == team for r in runs)  # never seed `seed`
    assert [by_id[i].status for i in first["runs"]] == ["completed"]
    (stopped,) = [by_id[i] for i in second["runs"]]
    assert stopped.config["train"]["num_updates"] == budget
    assert stopped.status == "cancelled" and stopped.updates_done < budget  # stopped early
    assert stopped.config["train"]["lr"] == 0.01
    assert grid.status == "completed" and grid.config["seed"] == seed
    assert grid.config["train"]["lr"] == 0.001  # the grid runs with the choice


@pytest.mark.slow
def test_gtr_study_run_tunes_prunes_and_runs_the_grid_with_the_choice(
    embedded: Embedded,
) -> None:
    stdout = embedded.out.stdout
    assert "tuning gtr trial 0 {'lr': 0.001}: runs 1" in stdout
    assert "tuning gtr trial 1: pruned at update 0" in stdout
    assert "tuning gtr: selected trial 0 {'lr': 0.001}" in stdout and "study 1 done" in stdout
    report = json.loads(gtr_cli("study", "report", "1", "--json", env=embedded.env).stdout)
    (arm,) = report["tuning"]
    with session_scope(embedded.url) as s:
        runs = list(s.scalars(select(Run).order_by(Run.id)))
        (grid,) = [r for r in runs if r.study_id == 1]
        trials = [r for r in runs if r.study_id is None]
        _check_stage(arm, trials, grid, "default", 0, EMBEDDED_BUDGET)
        study = s.get(Study, 1)
        assert study is not None and study.spec["arms"]["gtr"]["train"]["lr"] == 0.001
    text = gtr_cli("study", "report", "1", "--markdown", env=embedded.env).stdout
    assert "### Tuning" in text and "- gtr: selected trial 0 {'lr': 0.001}" in text
    # the tuning table: a row per trial, the chosen one in bold
    assert "| **gtr** | **0** | **lr: 0.001** | **score " in text
    assert "| gtr | 1 | lr: 0.01 | pruned at update 0 |" in text


@pytest.mark.slow
def test_a_second_gtr_study_run_does_not_tune_again(embedded: Embedded) -> None:
    with session_scope(embedded.url) as s:
        before = len(s.scalars(select(Run.id)).all())
    path = Path(str(embedded.env["GTR_DATA_DIR"])).parent / "pruned.toml"
    again = gtr_cli("study", "run", str(path), env=embedded.env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "tuning gtr trial" not in again.stdout and "started" not in again.stdout
    assert "study 1 done" in again.stdout
    with session_scope(embedded.url) as s:
        assert len(s.scalars(select(Run.id)).all()) == before


def _page_lists(c: httpx.Client, study_id: int, token: str, arm: Any) -> None:
    page = c.get(f"/studies/{study_id}", cookies={COOKIE_NAME: token})
    assert page.status_code == 200, page.text[:500]
    html = page.text
    assert 'id="tuning"' in html and html.count("<tr") >= 2
    for t in arm["trials"]:
        assert f"lr = {t['params']['lr']}" in html
    assert f"selected trial {arm['selected_trial']}" in html


def _controller(log: Path) -> subprocess.Popen[bytes]:
    """`gtr controller` on the session's PostgreSQL, every part of a run in its process (no
    Redis, env or policy service): it claims the study's runs and polls its scheduler."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GTR_REDIS_URL", "GTR_ENV_SERVICE_URL", "GTR_POLICY_SERVICE_URL")
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "controller", "--poll", "0.5"]
            + ["--stale-after", "6"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stack_body() -> dict[str, Any]:
    """The lr study as JSON: one arm, evaluation seed 1, 1 grid update, 3 per trial run."""
    base = tiny_run(Path("unused"), envs=2, steps=4, updates=1)
    base["init"] = {"kind": "none"}
    base["env"] = {**base.get("env", {}), "max_episode_steps": 3}
    base["generation"] = {**base.get("generation", {}), "max_new_tokens": 24}
    base["metrics"] = {**base.get("metrics", {}), "eval_every": 1, "probe_states": 2}
    return {
        "name": "tuned through the controllers",
        "tasks": {"numberline": {"base": base}},
        "arms": {"gtr": {"algorithm": "gtr"}},
        "seeds": [1],
        "eval_episodes": 4,
        "tuning": {
            "trials": 2,
            "seeds": [100],
            "updates": 3,
            "sampler": "grid",
            "pruner": "median",
            "metric": {"metric": "lr", "reduce": "mean", "higher_is_better": False},
            "arms": {"gtr": {"lr": {"choices": [0.001, 0.01]}}},
        },
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_study_posted_through_rest_tunes_through_a_controller_killed_mid_trial(
    api: httpx.Client, default_model_dir: Path, tmp_path: Path
) -> None:
    cancel_active_runs()  # a controller claims any queued run: only this test's may be there
    log = tmp_path / "controller.log"
    ctl = _controller(log)
    try:
        r = api.post("/api/studies", json=_stack_body())
        assert r.status_code == 201, r.text
        study_id = r.json()["id"]

        def trial_runs() -> list[Run]:
            with session_scope() as s:
                return [r for r in s.scalars(select(Run)) if _of(r, study_id)]

        def waited(what: str, check: Any, timeout_s: float) -> Any:
            deadline = time.monotonic() + timeout_s
            while not (out := check()):
                tail = log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, f"{what} after {timeout_s}s\n{tail}"
                time.sleep(0.3)
            return out

        # Killed inside trial 0's run (after its first update when the poll sees it), then
        # started again: the run resumes once its heartbeat is stale and the trial goes on.
        waited(
            "trial 0's run did not get going",
            lambda: (
                any(r.status == "running" and r.updates_done >= 1 for r in trial_runs())
                or any(r.status == "completed" for r in trial_runs())
            ),
            300,
        )
        _stop(ctl)
        assert api.get(f"/api/studies/{study_id}").json()["tuning"][0]["selected"] is None
        ctl = _controller(log)

        def finished() -> dict[str, Any] | None:
            got = api.get(f"/api/studies/{study_id}")
            assert got.status_code == 200, got.text
            body = got.json()
            return body if body["status"] in ("done", "failed", "cancelled") else None

        report = waited("the study did not finish", finished, 420)
        assert report["status"] == "done", report["progress"]
        (arm,) = report["tuning"]
        with session_scope() as s:
            (grid,) = s.scalars(select(Run).where(Run.study_id == study_id)).all()
            _check_stage(arm, trial_runs(), grid, TEAM, 1, 3)
            # Optuna's tables live in their own schema of the platform's database.
            where = s.execute(
                text("SELECT table_schema FROM information_schema.tables WHERE table_name = :t"),
                {"t": "trials"},
            ).scalars()
            assert set(where) == {"optuna"}
        token = str(api.headers["Authorization"]).removeprefix("Bearer ")
        _page_lists(api, study_id, token, arm)
    finally:
        _stop(ctl)
        cancel_active_runs()


def _of(run: Run, study_id: int) -> bool:
    return run.study_id is None and (run.info or {}).get("tuning", {}).get("study_id") == study_id


def _poll(study_id: int) -> list[Run]:
    """One poll of the study's scheduler, as a controller makes it; the runs it queued."""
    with session_scope() as s:
        study = s.get(Study, study_id)
        assert study is not None
        return service.advance(s, study)


def test_the_stage_moves_on_what_the_database_holds(pg_url: str) -> None:
    """The state machine alone, fast: the runs' rows written as a driver writes them. A poll
    that rolls back is repaired by the next; a cancelled study stops a trial's runs and resume
    queues them again; a trial behind at its first report is stopped through the cancel flag and
    told pruned once its run ended; then the grid is queued with the choice."""
    from shared.db.models import Update
    from shared.db.session import session_factory

    team = "tuning-state"
    with session_scope() as s:
        cfg = StudyConfig.model_validate({**_stack_body(), "name": "polled"})
        study_id = service.create_study(s, cfg, team).id

    def trial(n: int) -> Run:
        with session_scope() as s:
            (run,) = [r for r in tuning.trial_runs(s, study_id) if r.info["tuning"]["trial"] == n]
            s.expunge(run)
            return run

    def record(run_id: int, status: str, lrs: list[float]) -> None:
        with session_scope() as s:
            run = s.get(Run, run_id)
            assert run is not None
            for i, lr in enumerate(lrs):
                metrics = {"lr": lr, "update_s": 10.0 * (i + 1)}
                s.add(Update(run_id=run_id, idx=run.updates_done + i, metrics=metrics))
            run.status, run.updates_done = status, run.updates_done + len(lrs)

    lost = session_factory()()
    study = lost.get(Study, study_id)
    assert study is not None
    assert len(service.advance(lost, study)) == 1  # trial 0 asked, its run queued...
    lost.rollback()  # ...and that poll's transaction lost
    lost.close()
    (queued,) = _poll(study_id)  # repaired: trial 0's run, once
    assert queued.info["tuning"]["trial"] == 0 and _poll(study_id) == []
    assert queued.team == team and queued.config["train"]["lr"] == 0.001
    with session_scope() as s:
        study = s.get(Study, study_id)
        assert study is not None and study.status == "queued"
        service.cancel_study(s, study)
    assert trial(0).status == "cancelled"
    with session_scope() as s:
        study = s.get(Study, study_id)
        assert study is not None
        service.resume_study(s, study)
    assert _poll(study_id) == [] and trial(0).status == "queued"  # queued again, not a new trial
    record(trial(0).id, "completed", [0.001, 0.0005])
    (second,) = _poll(study_id)  # trial 0 told complete, trial 1 asked
    assert second.info["tuning"]["trial"] == 1 and second.config["train"]["lr"] == 0.01
    record(second.id, "running", [0.01])
    assert _poll(study_id) == [] and trial(1).cancel_requested  # behind at its first report
    with session_scope() as s:
        study = s.get(Study, study_id)
        assert study is not None and study.status == "running"
    record(second.id, "cancelled", [])
    (grid,) = _poll(study_id)  # told pruned; the choice made; the grid queued with it
    assert grid.study_id == study_id and grid.config["train"]["lr"] == 0.001
    (arm,) = tuning.tuning_report(cfg, study_id)
    assert [(t.state, t.score, t.stopped_at) for t in arm.trials] == [
        ("complete", 0.00075, None),
        ("pruned", None, 0),
    ]
    assert arm.selected == {"lr": 0.001} and arm.selected_trial == 0
    # `--stop-by`'s estimate of the arm's first grid run: no grid run of the arm has trained,
    # so its trials' seconds per update (trial 0: 10 and 20, trial 1: 10) times 1 update.
    with session_scope() as s:
        first = s.get(Run, grid.id)
        assert first is not None and first.num_updates == 1
        assert seconds_needed(s, first) == pytest.approx((15.0 + 10.0) / 2)


def test_an_arm_whose_trials_all_fail_keeps_its_own_settings_and_says_so(pg_url: str) -> None:
    """Every trial's run failed: the stage still ends (the grid is not held forever), the arm
    trains with the study's own settings, and the report, the CLI's lines and the study page
    say no trial completed instead of naming a selection that does not exist."""
    team = "tuning-all-failed"
    with session_scope() as s:
        cfg = StudyConfig.model_validate({**_stack_body(), "name": "nothing completes"})
        study_id = service.create_study(s, cfg, team).id
        _, token = create_token(s, "tuning page", "read", team)

    def fail(run: Run) -> None:
        with session_scope() as s:
            row = s.get(Run, run.id)
            assert row is not None
            row.status = "failed"

    for n in range(2):  # the budget: 2 trials, each one run, each failed
        (queued,) = _poll(study_id)
        assert queued.info["tuning"]["trial"] == n
        fail(queued)
    (grid,) = _poll(study_id)  # the stage ends with no choice; the grid runs the arm as declared
    own = RunConfig.model_validate(_stack_body()["tasks"]["numberline"]["base"]).train.lr
    assert grid.study_id == study_id and grid.config["train"]["lr"] == own
    (arm,) = tuning.tuning_report(cfg, study_id)
    assert [t.state for t in arm.trials] == ["fail", "fail"]
    assert arm.selected == {} and arm.selected_trial is None
    (line, *_) = tuning.report_lines([arm])
    assert "no trial completed: the arm keeps its own settings" in line
    with live_server(create_app()) as url, httpx.Client(base_url=url) as c:
        page = c.get(f"/studies/{study_id}", cookies={COOKIE_NAME: token})
    assert page.status_code == 200, page.text[:500]
    assert "no trial completed: the arm keeps its own settings" in page.text
    assert "selected trial None" not in page.text


def test_a_half_done_stage_carried_to_another_store_goes_on_where_it_was(pg_url: str) -> None:
    """A bundle exported mid-stage: trial 0 complete, trial 1's run still running. The import
    carries trial 0 only; the next poll here asks for the grid point trial 1 had (lr 0.01), as
    trial 1, which the pruner judges against the carried trial's reports; the choice is the
    carried trial."""
    from services.study.tuning_carry import check_stage, export_stage, install_stage
    from shared.db.models import Update

    with session_scope() as s:
        cfg = StudyConfig.model_validate({**_stack_body(), "name": "carried-from"})
        source = service.create_study(s, cfg, "carry-a").id
    (first,) = _poll(source)
    with session_scope() as s:
        run = s.get(Run, first.id)
        assert run is not None
        s.add(Update(run_id=run.id, idx=0, metrics={"lr": 0.001, "update_s": 12.5}))
        run.status, run.updates_done = "completed", 1
    (running,) = _poll(source)  # trial 0 told complete; trial 1 asked, its run in flight
    assert running.config["train"]["lr"] == 0.01
    with session_scope() as s:  # as the bundle holds it
        carried = json.loads(json.dumps(export_stage(s, cfg, source)))
    assert [t["number"] for t in carried[0]["trials"]] == [0] and carried[0]["selected"] is None
    assert carried[0]["trials"][0]["update_s"] == 12.5  # its seconds per update, carried

    with session_scope() as s:
        target = service.create_study(s, cfg.model_copy(update={"name": "carried-to"}), "b").id
    lines = install_stage(cfg, target, check_stage(cfg, carried))
    assert lines == ["tuning gtr: 1 finished trials carried, no choice yet"]
    (arm,) = tuning.tuning_report(cfg, target)  # the unfinished grid point waits, settings shown
    assert [(t.number, t.params, t.state) for t in arm.trials] == [
        (0, {"lr": 0.001}, "complete"),
        (1, {"lr": 0.01}, "waiting"),
    ]
    assert tuning.trial_text(arm.trials[1]) == "trial 1 {lr: 0.01}: waiting"
    (asked,) = _poll(target)  # the grid point trial 1 never finished, and nothing else
    assert asked.info["tuning"]["trial"] == 1 and asked.config["train"]["lr"] == 0.01
    with session_scope() as s:
        run = s.get(Run, asked.id)
        assert run is not None
        s.add(Update(run_id=run.id, idx=0, metrics={"lr": 0.01}))
        run.status, run.updates_done = "completed", 1
    (grid,) = _poll(target)  # trial 1 behind trial 0's carried report: pruned; the choice made
    assert grid.study_id == target and grid.config["train"]["lr"] == 0.001
    with session_scope() as s:  # `--stop-by`: trial 0 ran elsewhere, its figure came along
        row = s.get(Run, grid.id)
        assert row is not None and seconds_needed(s, row) == pytest.approx(12.5 * row.num_updates)
    (arm,) = tuning.tuning_report(cfg, target)
    assert [(t.number, t.params, t.state, t.runs) for t in arm.trials] == [
        (0, {"lr": 0.001}, "complete", []),
        (1, {"lr": 0.01}, "pruned", [asked.id]),
    ]
    assert arm.trials[1].stopped_at == 0
    assert arm.selected == {"lr": 0.001} and arm.selected_trial == 0


def test_a_bundle_exported_mid_stage_carries_the_tuning_seeds_warm_start(
    pg_url: str, warm_checkpoint: Path
) -> None:
    """A stage that spans sessions: its trials on a tuning seed compare like for like only from
    the same weights, so the bundle carries the tuning seed's cached warm start while an arm has
    no choice, and the import files it where the next trials reuse it."""
    from services.controller.backends import InProcessPolicy, InProcessTrainer, ThreadCorrections
    from services.controller.service import RunDriver
    from services.env import EnvPool
    from services.study.bundle import export_study, import_study, install_warm_starts
    from services.study.tuning_carry import install_stage
    from shared.settings import get_settings

    body = _stack_body()
    base = tiny_run(warm_checkpoint, envs=2, steps=4, updates=1)
    base["init"] = {"kind": "warm_start", "vision_steps": 0, "sft_samples": 8, "sft_steps": 2,
                    "batch_size": 4}  # fmt: skip
    body["tasks"]["numberline"]["base"] = base
    body["name"] = "warm mid-stage"
    with session_scope() as s:
        cfg = StudyConfig.model_validate(body)
        study_id = service.create_study(s, cfg, "carry-warm").id
    (trial0,) = _poll(study_id)
    run_cfg = RunConfig.model_validate(trial0.config)
    corrections = ThreadCorrections("oracle", 0.0, run_cfg.seed, get_settings(), run_id=trial0.id)
    try:
        driver = RunDriver(
            trial0.id, EnvPool(), InProcessPolicy(run_cfg.model), corrections, InProcessTrainer()
        )
        assert driver.run() == "completed"
    finally:
        corrections.close()
    with session_scope() as s:
        run = s.get(Run, trial0.id)
        assert run is not None
        key = run.info["warm_start"]["key"]
        bundle = json.loads(json.dumps(export_study(s, study_id)))  # as the file holds it
    by_seed = {w["cell"]["seed"]: w for w in bundle["warm_starts"]}
    assert sorted(by_seed) == [1, 100] and by_seed[1]["entry"] is None  # the grid's: not built
    warm = by_seed[100]
    assert warm["cell"] == {"task": "numberline", "arm": "gtr", "seed": 100, "variant": ""}
    assert warm["entry"] is not None and warm["entry"]["weights_sha256"]
    assert bundle["tuning"][0]["trials"] == []  # trial 0 not told complete yet: asked again

    with session_scope() as s:
        got = import_study(s, bundle, "carry-warm-b")
    assert got.spec is not None
    assert install_stage(got.spec, got.study_id, got.tuning) == [
        "tuning gtr: 0 finished trials carried, no choice yet"
    ]
    with session_scope() as s:
        lines = install_warm_starts(s, bundle, got.study_id)
    assert lines == [f"the warm start of numberline seed 100 is in this cache ({key[:12]}): "
                     "its seed's next runs reuse it"]  # fmt: skip


def test_a_choice_at_an_end_of_a_grid_of_three_or_more_values_is_named() -> None:
    """Each arm "at its best" is in doubt where its choice sits at an end of a grid that could
    have found an interior best; a two-value or bool knob, or a sampled range, says nothing."""
    knobs = {
        "lr": KnobSpec(choices=[3e-5, 1e-4, 3e-4, 1e-3]),
        "sft_epochs": KnobSpec(choices=[2, 4]),
        "clip_per_loss": KnobSpec(choices=[False, True]),
        "sft_coef": KnobSpec(low=0.5, high=4.0),
    }
    at_ends = {"lr": 1e-3, "sft_epochs": 4, "clip_per_loss": True, "sft_coef": 4.0}
    assert tuning.grid_edges(knobs, at_ends) == ["lr 0.001 is the largest of the 4 values searched"]
    low = tuning.grid_edges(knobs, {"lr": 3e-5})
    assert low == ["lr 3e-05 is the smallest of the 4 values searched"]
    assert tuning.grid_edges(knobs, {"lr": 1e-4, "sft_epochs": 2}) == []
    # an integer grid given in any order, its choice at the low end
    ints = {"sft_epochs": KnobSpec(choices=[4, 1, 2])}
    assert tuning.grid_edges(ints, {"sft_epochs": 1}) == [
        "sft_epochs 1 is the smallest of the 3 values searched"
    ]
