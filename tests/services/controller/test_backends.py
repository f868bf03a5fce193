from __future__ import annotations

import time
from datetime import timedelta

from sqlalchemy import select, update

from services.api.service import create_run
from services.controller.backends import (
    CeleryCorrections,
    CorrectionSweep,
    ThreadCorrections,
    record_missing_as_failed,
    settle_corrections,
    wait_for_corrections,
)
from services.controller.recorder import add_step, open_episode
from shared.db.models import Correction, Step, utcnow
from shared.db.session import session_scope
from shared.queues import QUEUE_CORRECTOR, celery_app
from shared.schemas import RunConfig
from shared.settings import Settings
from shared.storage import blob_store
from tests.conftest import celery_worker


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


def _queued_long_ago(step_ids: list[int]) -> None:
    with session_scope() as s:
        s.execute(
            update(Step)
            .where(Step.id.in_(step_ids))
            .values(created_at=utcnow() - timedelta(hours=1))
        )


def _corrections(run_id: int) -> dict[int, tuple[str, str | None]]:
    with session_scope() as s:
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id)).all()
        return {r.step_id: (r.status, r.error) for r in rows}


def test_the_sweep_sends_lost_corrections_again_to_a_real_worker(redis_url: str) -> None:
    """corrector.wait = "none": tasks lost with Redis's data (here: never sent) are sent again
    once by the per-update sweep when older than the timeout; a young one is left to its task
    until the run's end, where ``finish`` sends it and the worker corrects it."""
    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    celery_app.control.purge()
    run_id, ids = _steps(4, state={"current": 2, "target": 4})
    _queued_long_ago(ids[:3])
    with session_scope() as s:  # one already corrected: not sent again
        s.add(Correction(step_id=ids[0], run_id=run_id, update_idx=0, corrector="oracle"))
        s.flush()
        s.execute(update(Correction).where(Correction.step_id == ids[0]).values(status="done"))
    sweep = CorrectionSweep(CeleryCorrections("oracle"), run_id, "oracle", timeout_s=5.0)
    with celery_worker(QUEUE_CORRECTOR):
        assert sweep.sweep(0) == 2
        assert sweep.sweep(0) == 0  # once each: still missing or not, not sent a second time
        assert wait_for_corrections(run_id, ids[1:3], timeout_s=60) == 0
        assert sweep.finish() == 0
    assert {i: st for i, (st, _) in _corrections(run_id).items()} == dict.fromkeys(ids, "done")
    assert sweep.from_update == 0  # nothing missing past update 0 at the last sweep


def test_corrections_that_never_come_are_recorded_failed_once_sent_twice(redis_url: str) -> None:
    """No worker takes the re-sent tasks: a sweep past twice the timeout records them failed
    with the reason, and ``finish`` does the same for the rest, a pending row included."""
    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    celery_app.control.purge()
    run_id, ids = _steps(3, state={"current": 2, "target": 4})
    _queued_long_ago(ids[:1])
    with session_scope() as s:
        s.add(Correction(step_id=ids[2], run_id=run_id, update_idx=0, corrector="oracle"))
    sweep = CorrectionSweep(CeleryCorrections("oracle"), run_id, "oracle", timeout_s=0.5)
    try:
        assert sweep.sweep(0) == 1
        time.sleep(0.7)
        assert sweep.sweep(1) == 2  # the first is now failed; the two others are old now
        assert _corrections(run_id)[ids[0]] == ("failed", "timeout: no answer within 1 s")
        assert sweep.finish() == 2
    finally:
        celery_app.control.purge()
    got = _corrections(run_id)
    assert [got[i][0] for i in ids] == ["failed"] * 3, got
    assert sweep.sweep(2) == 0 and sweep.from_update == 2


def test_the_in_process_policy_samples_in_the_runs_dtype(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    from services.controller.backends import InProcessPolicy
    from services.policy.service import Policy
    from shared.schemas import ModelConfig

    Policy.load(tiny_model_dir, lora_r=4).save(tmp_path / "ckpt")
    frame = np.zeros((64, 64, 3), dtype=np.uint8)
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        served = InProcessPolicy(ModelConfig(dtype=dtype))
        served.load_weights(tmp_path / "ckpt")
        first = served.policy
        assert isinstance(first, Policy) and first.dtype == want
        assert next(first.model.parameters()).dtype == want
        [gen] = served.generate([frame], ["Move toward the target."], max_new_tokens=4, seed=0)
        assert 0 < len(gen.token_ids) <= 4 and len(gen.logprobs) == len(gen.token_ids)
        served.load_weights(tmp_path / "ckpt")  # the same base model: the same policy object
        assert served.policy is first
