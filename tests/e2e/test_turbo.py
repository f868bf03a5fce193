"""gtr_grpo with the self-teacher corrector, and gtr_turbo_kl, as whole (tiny) runs: the
controller, envs, policy and trainer in this process, on the test database; the self-teacher
serves the corrections from a real Celery corrector worker (its own process, on Redis)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import CeleryCorrections, InProcessPolicy, InProcessTrainer
from services.controller.service import RunDriver
from services.env import EnvPool
from shared.db.models import Checkpoint, Correction, Episode, Step, Update
from shared.db.session import session_scope
from shared.queues import QUEUE_CORRECTOR, celery_app
from shared.schemas import RunConfig
from tests.conftest import celery_worker
from tests.e2e.helpers import tiny_config

pytestmark = pytest.mark.slow


def _run(cfg: RunConfig, corrections: bool) -> int:
    with session_scope() as s:
        run_id = create_run(s, cfg, "turbo-test").id
    pool = CeleryCorrections(cfg.corrector.name) if corrections else None
    driver = RunDriver(run_id, EnvPool(), InProcessPolicy(cfg.model), pool, InProcessTrainer())
    assert driver.run() == "completed"
    return run_id


def _config(checkpoint: Path, envs: int, steps: int, **extra: object) -> RunConfig:
    raw = tomllib.loads(tiny_config(checkpoint, envs=envs, steps=steps, updates=2))
    for section, values in extra.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    raw["metrics"]["probe_states"] = 2
    return RunConfig.model_validate(raw)


def test_gtr_grpo_with_the_self_teacher_and_gtr_turbo_kl(
    pg_url: str, redis_url: str, warm_checkpoint: Path
) -> None:
    # gtr_grpo: 4 envs in groups of 2, the self-teacher corrects (waited for before each update).
    cfg = _config(
        warm_checkpoint,
        4,
        4,
        algorithm="gtr_grpo",
        env={"max_episode_steps": 2},  # episodes end inside the rollout: complete groups
        train={"group_size": 2},
        corrector={"backend": "self_teacher"},
    )
    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    with celery_worker(QUEUE_CORRECTOR):
        run_id = _run(cfg, corrections=True)
    with session_scope() as s:
        metrics = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
        # 4 envs x 4 steps, episodes of at most 2 steps: at least 2 groups (group, k) each.
        assert all(m["grpo/groups"] >= 4 and m["grpo/episodes"] >= 8 for m in metrics), metrics
        assert all("losses/value" in m for m in metrics)  # reported, though not trained
        # Each env's episodes (first-step states, in order) per update: a group's two envs
        # play the same deals (the k-th of each, whenever it starts); the other group others.
        starts: dict[tuple[int, int], list] = {}
        for e, st in s.execute(
            select(Episode, Step)
            .join(Step, Step.episode_id == Episode.id)
            .where(Episode.run_id == run_id, Step.idx == 0)
            .order_by(Episode.id)
        ):
            starts.setdefault((e.update_idx, e.env_index), []).append(st.state)
        for u in (0, 1):
            for a, b in ((0, 1), (2, 3)):  # the k-th episodes of a group: one deal
                pairs = list(zip(starts[(u, a)], starts[(u, b)], strict=False))
                assert len(pairs) >= 2 and all(x == y for x, y in pairs)
            assert starts[(u, 0)] != starts[(u, 2)]
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id)).all()
        assert rows and {r.corrector for r in rows} == {"self_teacher"}, [
            (r.corrector, r.status, r.error, r.update_idx, r.step_id)
            for r in rows
            if r.corrector != "self_teacher"
        ][:5]
        done = [r for r in rows if r.status == "done"]
        assert done and all(r.tokens == 0 for r in done)
        ckpt0 = s.scalar(
            select(Checkpoint.id).where(Checkpoint.run_id == run_id, Checkpoint.update_idx == 0)
        )
        # Update 0 was corrected by the warm start; update 1 by the merge of checkpoint 0.
        assert {tuple(r.extras["teacher_updates"]) for r in done if r.update_idx == 0} <= {()}
        later = [r.extras for r in done if r.update_idx == 1]
        assert later and all(x["teacher_checkpoint_ids"] == [ckpt0] for x in later)

    # gtr_turbo_kl: no corrector; the KL penalty against the merged teacher enters the returns.
    run_id = _run(_config(warm_checkpoint, 2, 2, algorithm="gtr_turbo_kl"), corrections=False)
    with session_scope() as s:
        metrics = s.scalars(
            select(Update.metrics).where(Update.run_id == run_id).order_by(Update.idx)
        ).all()
        assert [m["turbo/teacher_newest_update"] for m in metrics] == [-1.0, 0.0]
        assert all(m["turbo/kl_mean"] >= 0 for m in metrics)
        assert not s.scalars(select(Correction.id).where(Correction.run_id == run_id)).all()
