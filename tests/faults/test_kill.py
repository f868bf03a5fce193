"""Fault injection on the full stack: during a running tiny run, kill -9 one part and restart it.

Everything runs as real processes on a PostgreSQL cluster and a Redis server that this module
starts for itself (temporary folder, free ports), so both can be restarted without touching the
machine's shared servers. After each fault: the run completes (or resumes from its last
checkpoint), every step is recorded exactly once, every well-formed step has its correction
(done, or failed with a reason), and the checkpoint chain has no gap. While waiting, any part
that exited is started again, as compose (`restart: unless-stopped`) and Kubernetes do.

Where the platform does not survive a fault yet, the test stays, marked
``xfail(strict=False, raises=NotSurvived)`` (non-strict: timing can let a known gap pass):
only the survival check may fail; a duplicate step or a gap in the checkpoint chain
still fails the test. docs/reliability.md has the table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from services.api.auth import create_token
from services.corrector.registry import create_corrector
from services.corrector.schemas import CorrectorCreate
from shared.db.models import Checkpoint, Correction, Run, Step, Update
from shared.db.session import session_scope
from shared.settings import Settings
from tests.conftest import need
from tests.e2e.helpers import counts, tiny_config
from tests.faults.infra import PG_BIN, Postgres, Redis, Stack
from tests.services.corrector.conftest import FakeOpenAI, chat

pytestmark = pytest.mark.slow

E, S, U = 2, 4, 3  # envs, steps per update, updates of every run here
# Updates long enough that a fault lands inside one: the fault is injected within a fraction of
# a second of the trainer taking the task, and each epoch adds about a quarter second (2 cores).
# Every update of the run pays it, so no more epochs than the fault needs.
LONG_UPDATES = {"ppo_epochs": 10}


class NotSurvived(AssertionError):
    """The run did not complete (or lost a correction silently) after the fault."""


@pytest.fixture(scope="module")
def stack(warm_checkpoint: Path, default_model_dir: Path) -> Iterator[dict[str, Any]]:
    need(
        bool(PG_BIN) and shutil.which("redis-server") is not None,
        "initdb/pg_ctl (under /usr/lib/postgresql/*/bin) and redis-server are needed",
    )
    root = Path(tempfile.mkdtemp(prefix="gtr-faults-"))
    pg, redis_server = Postgres(root), Redis(root)
    pg.start()
    redis_server.start()
    subprocess.run(
        [f"{PG_BIN}/createdb", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "gtr"],
        check=True,
    )
    from shared.db.migrate import upgrade

    upgrade(pg.url)
    env = {
        **os.environ,
        "GTR_DATABASE_URL": pg.url,
        "GTR_REDIS_URL": redis_server.url,
        # A lost trainer task is sent again after 8 s without a sign of life (default 30 s).
        "GTR_TRAINER_LOST_AFTER_S": "8",
    }
    st = Stack(root, env, default_model_dir)
    try:
        st.start_all()
        with session_scope(pg.url) as s:
            token = create_token(s, "faults")[1]
        yield {
            "stack": st,
            "pg": pg,
            "redis": redis_server,
            "url": pg.url,
            "root": root,
            "checkpoint": warm_checkpoint,
            "headers": {"Authorization": f"Bearer {token}"},
        }
    finally:
        st.stop_all()
        redis_server.kill()
        pg.stop()
        from shared.db.session import get_engine

        get_engine(pg.url).dispose()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fresh(stack: dict) -> Iterator[dict]:
    """Every test starts with all parts up and no run in flight; a stuck run is stopped after."""
    st: Stack = stack["stack"]
    for name in st.args:
        if not st.alive(name):
            st.start(name)
    yield stack
    with session_scope(stack["url"]) as s:
        stuck = s.execute(  # type: ignore[attr-defined]
            update(Run)
            .where(Run.status.in_(("queued", "running")))
            .values(status="cancelled", cancel_requested=True)
        ).rowcount
    if stuck:  # a controller blocked on a lost task would hold the next run
        st.restart("controller")


# ---- launching, waiting, checking ----------------------------------------------------------


def _launch(stack: dict, train: dict | None = None, **corrector: Any) -> int:
    cfg = tomllib.loads(tiny_config(stack["checkpoint"], envs=E, steps=S, updates=U))
    cfg["corrector"].update({"wait_timeout_s": 20, **corrector})
    cfg["train"].update(train or {})
    r = httpx.post(
        f"{stack['stack'].urls['api']}/api/runs", json=cfg, headers=stack["headers"], timeout=30
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _until(
    what: str, ok: Callable[[], bool], timeout_s: float, stack: dict, every_s: float = 0.25
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except Exception:  # the database may be the part being restarted
            pass
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{stack['stack'].tails()}")


def _steps(stack: dict, run_id: int) -> int:
    with session_scope(stack["url"]) as s:
        return int(
            s.scalar(select(func.count()).select_from(Step).where(Step.run_id == run_id)) or 0
        )


def _status(stack: dict, run_id: int) -> tuple[str, str | None]:
    with session_scope(stack["url"]) as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run.status, run.error


def _mid_rollout(stack: dict, run_id: int) -> None:
    """Wait until the second update's rollout is under way (one update trained before it)."""
    _until("the second rollout", lambda: _steps(stack, run_id) > E * S + 1, 300, stack)


def _supervise(st: Stack) -> None:
    """Start again any part that exited, as the deployments do (compose `restart:
    unless-stopped`, Kubernetes Deployments): a part that gives up must not end the run."""
    for name in st.args:
        if not st.alive(name):
            st.start(name)


def _finish(stack: dict, run_id: int, timeout_s: float = 180) -> None:
    """The run must end completed within the timeout; then every invariant is checked."""
    deadline = time.monotonic() + timeout_s
    status, error = _status(stack, run_id)
    while status in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.5)
        _supervise(stack["stack"])
        try:
            status, error = _status(stack, run_id)
        except Exception:
            pass
    _no_duplicates(stack, run_id)
    if status != "completed":
        tails = stack["stack"].tails(("controller", "trainer"))
        raise NotSurvived(f"run {run_id} is {status} after the fault: {error}\n{tails}")
    _complete_and_consistent(stack, run_id)


def _no_duplicates(stack: dict, run_id: int) -> None:
    c = counts(run_id, stack["url"])
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0, c
    with session_scope(stack["url"]) as s:
        ckpts = sorted(s.scalars(select(Checkpoint.update_idx).where(Checkpoint.run_id == run_id)))
    assert ckpts == list(range(-1, len(ckpts) - 1)), f"a gap in the checkpoint chain: {ckpts}"


def _complete_and_consistent(stack: dict, run_id: int) -> None:
    c = counts(run_id, stack["url"])
    assert c["steps"] == c["env_steps"] == E * S * U, c
    assert c["checkpoints"] == U and c["updates"] == U, c
    with session_scope(stack["url"]) as s:
        trained = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
        assert all(m.get("trained") for m in trained)
        lost = s.scalar(
            select(func.count())
            .select_from(Step)
            .where(
                Step.run_id == run_id,
                Step.format_valid.is_(True),
                ~select(Correction.id).where(Correction.step_id == Step.id).exists(),
            )
        )
        pending = c["pending"]
    if lost or pending:
        raise NotSurvived(
            f"{lost} well-formed steps have no correction and {pending} are pending, "
            "with no recorded failure"
        )


# ---- the faults ----------------------------------------------------------------------------


def test_baseline_run_without_fault(fresh: dict) -> None:
    """The checks themselves pass on an undisturbed run (else every fault test proves nothing)."""
    run_id = _launch(fresh)
    _finish(fresh, run_id, 300)
    # The default: the policy service ran each rollout's loop, the controller read its stream
    # (the controller's own loop runs whole in tests/services/controller/test_wide_runs.py).
    with session_scope(fresh["url"]) as s:
        metrics = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
    assert metrics and all(m["time/stream_wait_s"] > 0 for m in metrics), metrics


def test_kill_the_controller_mid_rollout(fresh: dict) -> None:
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["stack"].kill("controller")
    fresh["stack"].start("controller")  # claims the run once its heartbeat is stale, resumes
    _finish(fresh, run_id, 300)


def test_kill_the_env_service_mid_rollout(fresh: dict) -> None:
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["stack"].restart("env")
    _finish(fresh, run_id)


def test_kill_the_policy_service_mid_rollout(fresh: dict) -> None:
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["stack"].restart("policy")
    _finish(fresh, run_id)


def test_kill_the_corrector_worker_with_calls_in_flight(fresh: dict) -> None:
    fake = FakeOpenAI()
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    fast = chat('{"evaluation": "YES", "correction": null}')
    slow = chat('{"evaluation": "YES", "correction": null}')
    slow.delay_s = 3.0  # a call is in flight for 3 s: the kill lands on one
    # The first rollout's calls (as many as the worker's 8 threads take at once) are slow, and
    # the kill comes with the first of them; the calls after the restart need not wait.
    fake.then(*[slow] * 8)
    fake.default = fast
    with session_scope(fresh["url"]) as s:
        create_corrector(
            s,
            CorrectorCreate(
                name=f"slow-{fake.server.server_address[1]}",
                kind="openai",
                base_url=fake.url,
                model="m",
                params={"max_retries": 0},
            ),
            "default",
            Settings(),
        )
    try:
        run_id = _launch(fresh, name=f"slow-{fake.server.server_address[1]}")
        _until("a correction call in flight", lambda: bool(fake.requests), 300, fresh)
        fresh["stack"].restart("corrector")
        _finish(fresh, run_id, 300)
    finally:
        fake.server.shutdown()


def _untrained_update(stack: dict, run_id: int) -> int | None:
    with session_scope(stack["url"]) as s:
        for idx, metrics in s.execute(
            select(Update.idx, Update.metrics).where(Update.run_id == run_id)
        ):
            if not metrics.get("trained"):
                return int(idx)
    return None


def _in_training(st: Stack) -> Callable[[], bool]:
    """True while the trainer worker has taken an update task (since now) and not finished it."""
    log = st.root / "trainer.log"
    seen = len(log.read_bytes())

    def check() -> bool:
        lines = log.read_bytes()[seen:].decode(errors="replace").splitlines()
        updates = [line for line in lines if "Task trainer.update[" in line]
        began = sum(line.endswith("received") for line in updates)
        return began > sum(" succeeded in " in line or " raised " in line for line in updates)

    return check


def test_kill_the_trainer_worker_mid_update(fresh: dict) -> None:
    training = _in_training(fresh["stack"])
    run_id = _launch(fresh, train=LONG_UPDATES)
    _until("the trainer inside an update", training, 300, fresh, every_s=0.05)
    killed = _untrained_update(fresh, run_id)
    fresh["stack"].kill("trainer")
    assert killed is not None and _untrained_update(fresh, run_id) == killed  # killed mid-update
    fresh["stack"].start("trainer")
    # Found lost after 8 s, then the update again (the model rebuilt first) and the rest.
    _finish(fresh, run_id, 90)


def test_restart_redis_mid_rollout(fresh: dict) -> None:
    """Redis is down for a few seconds (a restart, a failover) while the rollout queues
    corrections: nothing is lost if the controller waits for it to come back."""
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["redis"].kill()
    time.sleep(5.0)
    fresh["redis"].start()
    _finish(fresh, run_id, 150)


def test_restart_redis_mid_update(fresh: dict) -> None:
    """The worker holds the update task: it finishes, and its result lands in the new Redis."""
    training = _in_training(fresh["stack"])
    run_id = _launch(fresh, train=LONG_UPDATES)
    _until("the trainer inside an update", training, 300, fresh, every_s=0.05)
    fresh["redis"].kill()
    time.sleep(1.0)
    fresh["redis"].start()
    _finish(fresh, run_id, 150)


def test_restart_redis_with_an_update_queued(fresh: dict) -> None:
    """The trainer worker is away (a pod being rescheduled) when Redis restarts."""
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["stack"].kill("trainer")
    _until("an update queued", lambda: _untrained_update(fresh, run_id) is not None, 300, fresh)
    fresh["redis"].kill()
    time.sleep(1.0)
    fresh["redis"].start()
    fresh["stack"].start("trainer")
    _finish(fresh, run_id, 90)  # found lost after 8 s, sent again, then the rest of the run


def test_restart_postgres_mid_rollout(fresh: dict) -> None:
    run_id = _launch(fresh)
    _mid_rollout(fresh, run_id)
    fresh["pg"].crash_and_restart()
    _finish(fresh, run_id, 150)


def test_restart_redis_with_corrections_queued_and_no_wait(fresh: dict) -> None:
    """corrector.wait = "none": the corrector worker is away while the rollout queues its
    corrections, and Redis loses them; the controller's per-update sweep sends them again."""
    st: Stack = fresh["stack"]
    seen = len((st.root / "controller.log").read_bytes())  # the log spans the module's tests
    st.kill("corrector")
    run_id = _launch(fresh, wait="none", wait_timeout_s=3)
    _mid_rollout(fresh, run_id)
    fresh["redis"].kill()
    # The worker starts while Redis is down (its imports take seconds on a loaded host) and
    # is retrying when Redis returns: the re-sent corrections find it at work within their
    # 3 s. A worker that came up later would leave them failed and the run rightly degraded.
    log_at = len((st.root / "corrector.log").read_bytes())
    st.start("corrector")
    _until(
        "the corrector worker retrying its broker",
        lambda: b"Cannot connect" in (st.root / "corrector.log").read_bytes()[log_at:],
        120,
        fresh,
    )
    fresh["redis"].start()
    _finish(fresh, run_id, 120)
    assert b"corrections missing" in (st.root / "controller.log").read_bytes()[seen:]


def test_restart_postgres_mid_update(fresh: dict) -> None:
    """The trainer's transaction dies with the database: the task runs again once it is back."""
    st: Stack = fresh["stack"]
    seen = len((st.root / "trainer.log").read_bytes())
    training = _in_training(st)
    run_id = _launch(fresh, train=LONG_UPDATES)
    _until("the trainer inside an update", training, 300, fresh, every_s=0.05)
    fresh["pg"].crash_and_restart()
    _finish(fresh, run_id, 150)
    assert b"retry: Retry in" in (st.root / "trainer.log").read_bytes()[seen:], st.tails()
