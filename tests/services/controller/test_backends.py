from __future__ import annotations

from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import (
    ThreadCorrections,
    record_missing_as_failed,
    settle_corrections,
    wait_for_corrections,
)
from services.controller.recorder import add_step, open_episode
from shared.db.models import Correction
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import Settings
from shared.storage import blob_store


def _steps(n: int, state: dict | None = None) -> tuple[int, list[int]]:
    with session_scope() as s:
        run = create_run(s, RunConfig(task="numberline"), "ctrl-test")
        ep = open_episode(s, run.id, 0, 0, 0)
        ids = []
        for i in range(n):
            step = add_step(
                s,
                blob_store(),
                run_id=run.id,
                episode_id=ep.episode_id,
                idx=i,
                update_idx=0,
                rollout_pos=i,
                prompt="p",
                output="o",
                format_valid=True,
                action_valid=True,
                reward=0.0,
                done=False,
                state=state or {},
            )
            s.flush()
            ids.append(step.id)
        return run.id, ids


def test_timed_out_corrections_are_recorded_failed_once(pg_url: str) -> None:
    run_id, ids = _steps(3)
    with session_scope() as s:
        s.add(
            Correction(
                step_id=ids[0], run_id=run_id, update_idx=0, corrector="oracle", status="done"
            )
        )
    assert wait_for_corrections(run_id, ids, timeout_s=0.3) == 2
    assert record_missing_as_failed(run_id, ids, "oracle", 0.3) == 2
    assert record_missing_as_failed(run_id, ids, "oracle", 0.3) == 0  # idempotent
    with session_scope() as s:
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id)).all()
    assert sorted(r.status for r in rows) == ["done", "failed", "failed"]
    assert all("timeout" in (r.error or "") for r in rows if r.status == "failed")
    assert wait_for_corrections(run_id, ids, timeout_s=0.1) == 0


def test_missing_corrections_are_sent_again_once_before_they_fail(pg_url: str) -> None:
    """Tasks lost with a killed worker or with Redis's data (here: never sent) are sent again at
    the strict wait's timeout; what the re-send corrects is not recorded as a timeout."""
    run_id, ids = _steps(3, state={"current": 2, "target": 4})
    pool = ThreadCorrections("oracle", noise=0.0, seed=0, settings=Settings())
    try:
        assert settle_corrections(pool, run_id, ids, "oracle", timeout_s=3.0) == 0
    finally:
        pool.close()
    with session_scope() as s:
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id)).all()
    assert sorted(r.step_id for r in rows) == ids
    assert all(r.status == "done" for r in rows), [(r.status, r.error) for r in rows]
