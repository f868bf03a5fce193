"""`gtr study create` on the full stack (API, env, policy, trainer and corrector workers, a
controller, as separate processes on PostgreSQL and Redis): the controllers queue the study's
runs two at a time, a controller killed mid-run is replaced, its run resumes (not retried), and
the study ends done with every evaluation deal stored."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from services.api.auth import create_token
from shared.db.models import EvalOutcome, Run
from shared.db.session import session_scope
from shared.toml import dumps
from tests.e2e.helpers import ROOT, cancel_active_runs, counts, tiny_run
from tests.faults.infra import Stack

pytestmark = pytest.mark.slow

UPDATES = 2  # the controller is killed after update 0, the resumed run finishes update 1


@pytest.fixture(scope="module")
def stack(pg_url: str, redis_url: str, default_model_dir: Path) -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="gtr-study-stack-"))
    st = Stack(root, dict(os.environ), default_model_dir)  # the session's database and Redis
    cancel_active_runs()
    try:
        st.start_all()
        yield st
    finally:
        st.stop_all()
        cancel_active_runs()
        shutil.rmtree(root, ignore_errors=True)


def _study_file(path: Path, checkpoint: Path) -> Path:
    base = tiny_run(checkpoint, {"train": {"ppo_epochs": 4}}, envs=2, steps=4, updates=UPDATES)
    base["metrics"] = {"probe_states": 4, "eval_every": 1}
    study: dict[str, Any] = {
        "name": "stack study",
        "seeds": [1, 2],
        "eval_episodes": 4,
        "concurrency": 2,
        "tasks": {"numberline": {"base": base}},
        "arms": {"gtr": {"algorithm": "gtr"}, "rl4vlm": {"algorithm": "rl4vlm"}},
    }
    path.write_text(dumps(study))
    return path


def _wait(what: str, check: Any, timeout_s: float, st: Stack) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = check()
        if out:
            return out
        for name in st.args:  # a part that exited comes back, as under compose
            if name != "controller" and not st.alive(name):
                st.start(name)
        time.sleep(1)
    raise AssertionError(f"{what} after {timeout_s}s\n{st.tails(('controller',))}")


# The waits fit inside the test's timeout, so a stuck study fails with the controller's log.
@pytest.mark.timeout(900)
def test_gtr_study_create_runs_through_the_controllers_and_survives_a_killed_controller(
    stack: Stack, warm_checkpoint: Path, tmp_path: Path
) -> None:
    with session_scope() as s:
        token = create_token(s, "study-stack", "write", "study-stack")[1]
    path = _study_file(tmp_path / "study.toml", warm_checkpoint)
    api = ["--url", stack.urls["api"], "--token", token]
    created = subprocess.run(
        [sys.executable, "-m", "services.cli", "study", "create", str(path), *api],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert created.returncode == 0, created.stderr
    study_id = int(created.stdout.strip())

    def active() -> list[tuple[int, str, int]]:
        with session_scope() as s:
            rows = s.execute(
                select(Run.id, Run.status, Run.updates_done).where(Run.study_id == study_id)
            ).all()
        return [(int(i), str(st), int(u)) for i, st, u in rows]

    # Never more than `concurrency` runs in flight; kill the controller inside a run.
    def midway() -> int | None:
        rows = active()
        assert sum(st in ("queued", "running") for _, st, _ in rows) <= 2, rows
        return next((i for i, st, u in rows if st == "running" and 1 <= u < UPDATES), None)

    killed_run = _wait("no study run got midway", midway, 300, stack)
    stack.kill("controller")
    time.sleep(1)
    stack.start("controller")  # resumes the run once its heartbeat is stale (--stale-after 6)

    headers = {"Authorization": f"Bearer {token}"}

    def finished() -> dict | None:
        r = httpx.get(f"{stack.urls['api']}/api/studies/{study_id}", headers=headers, timeout=30)
        # the report of a study in progress, too
        assert r.status_code == 200, f"{r.text}\n{stack.tails(('api',))}"
        body = r.json()
        return body if body["status"] in ("done", "failed", "cancelled") else None

    report = _wait("the study did not finish", finished, 480, stack)
    assert report["status"] == "done", report["progress"]
    with session_scope() as s:
        runs = s.scalars(select(Run).where(Run.study_id == study_id)).all()
        assert len(runs) == 4 and {r.status for r in runs} == {"completed"}
        assert {r.study_attempt for r in runs} == {1}  # the killed run resumed, not retried
        rows = s.execute(
            select(EvalOutcome.run_id, EvalOutcome.update_idx).where(
                EvalOutcome.run_id.in_([r.id for r in runs])
            )
        ).all()
    assert sum(u >= 0 for _, u in rows) == 4 * UPDATES * 4
    # The start's evaluation, before update 0: the killed run recorded its own with update 0
    # (a run cut between training update 0 and recording it resumes past its start).
    starts = {run_id for run_id, u in rows if u == -1}
    assert killed_run in starts and sum(u == -1 for _, u in rows) == 4 * len(starts) >= 12
    c = counts(killed_run)
    assert c["checkpoints"] == UPDATES and c["dup_steps"] == 0 and c["steps"] == 2 * 4 * UPDATES
    listed = subprocess.run(
        [sys.executable, "-m", "services.cli", "study", "list", *api],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"{study_id}\tdone\t4/4 done, 0 failed" in listed.stdout, listed.stdout
