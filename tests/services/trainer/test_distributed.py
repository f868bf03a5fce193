"""The accelerate path: `accelerate launch` of one update on one CPU process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sqlalchemy import delete

from services.policy.service import Policy
from services.trainer import runs
from services.trainer.distributed import launch
from shared.db.models import Checkpoint, Run, Update
from shared.db.session import session_scope
from tests.services.trainer.dbutil import make_run, make_update
from tests.services.trainer.test_tasks import run_config, store_rollout

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "accelerate" / "cpu.yaml"


def test_accelerate_launch_trains_one_update_and_rank0_records_it(pg_url, tiny_dir) -> None:  # type: ignore[no-untyped-def]
    policy = Policy.load(tiny_dir, finetune="full")
    with session_scope(pg_url) as s:
        run = make_run(s, run_config(tiny_dir))
        runs.run_init(s, run.id)
        make_update(s, run, 0, store_rollout(policy, [1.0, -1.0]))
        run_id = run.id
    try:
        metrics = launch(run_id, 0, str(CONFIG))
        assert metrics["trained"] and np.isfinite(metrics["losses/policy"])
        assert launch(run_id, 0, str(CONFIG)) == {"skipped": True}
        with session_scope(pg_url) as s:
            idx = [c.update_idx for c in s.query(Checkpoint).filter_by(run_id=run_id)]
            assert sorted(idx) == [-1, 0]
            assert s.query(Update).filter_by(run_id=run_id, idx=0).one().metrics["trained"]
    finally:
        with session_scope(pg_url) as s:
            s.execute(delete(Run).where(Run.id == run_id))
