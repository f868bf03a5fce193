"""run_init / run_update against PostgreSQL in process, and the Celery worker on real Redis."""

from __future__ import annotations

import numpy as np
import torch
from sqlalchemy import delete

from services.policy.service import Policy
from services.trainer import runs
from services.trainer.checkpoint import get_checkpoint, latest_checkpoint
from shared.db.models import Checkpoint, Run, Update
from shared.db.session import session_scope
from shared.queues import TASK_UPDATE, celery_app
from shared.schemas import RunConfig
from shared.storage import CheckpointStore, blob_store, checkpoint_store
from tests.conftest import celery_worker
from tests.services.trainer.conftest import put_image, rollout_of
from tests.services.trainer.dbutil import make_run, make_update

TEXTS = [
    '{"current number": 1, "target number": 4, "thoughts": "1 < 4", "action": "+"}',
    '{"current number": 4, "target number": 1, "thoughts": "4 > 1", "action": "-"}',
]


def run_config(tiny_dir, **train) -> RunConfig:  # type: ignore[no-untyped-def]
    return RunConfig.model_validate(
        {
            "task": "numberline",
            "algorithm": "rl4vlm",
            "init": {"kind": "none"},
            "model": {"path": str(tiny_dir), "finetune": "full"},
            "train": {
                "num_envs": 2,
                "num_steps": 1,
                "num_updates": 3,
                "minibatch_size": 2,
                "ppo_epochs": 1,
                "lr": 1e-3,
                **train,
            },
        }
    )


def store_rollout(policy: Policy, rewards: list[float]) -> str:
    shas = [put_image((250, 0, 0)), put_image((0, 250, 0))]
    return blob_store().put(rollout_of(policy, shas, ["go", "go"], TEXTS, rewards, 2).to_bytes())


def head(path) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    return load_file(str(path / "value_head.safetensors"))["bias"]


def test_init_then_updates_resume_from_the_checkpoint(db, tiny_dir) -> None:  # type: ignore[no-untyped-def]
    run = make_run(db, run_config(tiny_dir))
    assert runs.run_init(db, run.id) == {} and runs.run_init(db, run.id) == {"skipped": True}
    init = get_checkpoint(db, run.id, -1)
    assert init is not None and init.size_bytes > 0
    policy = Policy.load(tiny_dir, finetune="full")
    for k, rewards in enumerate(([1.0, -1.0], [-1.0, 1.0])):
        make_update(db, run, k, store_rollout(policy, rewards))
    m0 = runs.run_update(db, run.id, 0)
    assert np.isfinite(m0["losses/policy"]) and runs.run_update(db, run.id, 0) == {"skipped": True}
    runs.forget_run(run.id)  # a new worker process: the trainer comes back from checkpoint 0
    m1 = runs.run_update(db, run.id, 1)
    assert m1["lr"] < m0["lr"]  # the cosine schedule resumed at its second step
    rows = db.query(Update).filter_by(run_id=run.id).order_by(Update.idx).all()
    assert all(r.metrics["trained"] and "losses/value" in r.metrics for r in rows)
    last = latest_checkpoint(db, run.id)
    path = checkpoint_store().resolve(last.path)
    assert last.update_idx == 1 and CheckpointStore.digest(path) == (last.size_bytes, last.sha256)
    reloaded = Policy.load(tiny_dir, finetune="full")
    reloaded.load_weights(path)  # the checkpoint loads into a fresh policy
    assert torch.equal(reloaded.value_head.bias.detach(), head(path))
    assert not torch.equal(head(path), torch.zeros(1))  # the value head trained


def test_worker_does_not_train_a_redelivered_update_twice(pg_url, redis_url, tiny_dir) -> None:  # type: ignore[no-untyped-def]
    policy = Policy.load(tiny_dir, finetune="full")
    with session_scope(pg_url) as s:
        run = make_run(s, run_config(tiny_dir))
        runs.run_init(s, run.id)
        make_update(s, run, 0, store_rollout(policy, [1.0, -1.0]))
        run_id = run.id
    try:
        with celery_worker("trainer"):
            first = celery_app.send_task(TASK_UPDATE, args=[run_id, 0])
            again = celery_app.send_task(TASK_UPDATE, args=[run_id, 0])  # a redelivery
            results = [first.get(timeout=240), again.get(timeout=240)]
        assert sum(r.get("skipped", False) for r in results) == 1
        trained = next(r for r in results if not r.get("skipped"))
        with session_scope(pg_url) as s:
            rows = s.query(Checkpoint).filter_by(run_id=run_id).order_by(Checkpoint.update_idx)
            assert [r.update_idx for r in rows] == [-1, 0]
            assert rows[1].id == trained["checkpoint_id"]
            row = s.query(Update).filter_by(run_id=run_id, idx=0).one()
            assert row.metrics["losses/policy"] == trained["losses/policy"]
    finally:
        with session_scope(pg_url) as s:
            s.execute(delete(Run).where(Run.id == run_id))  # cascades in the database
