"""grpo and gtr_turbo_kl as whole (tiny) runs: the controller, envs, policy and trainer in this
process, on the test database. gtr_grpo with the self-teacher corrector as a Celery worker runs
over REST on the full stack (tests/e2e/test_full_stack.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import InProcessPolicy, InProcessTrainer
from services.controller.service import RunDriver
from services.env import EnvPool
from services.study import report
from shared.db.models import Correction, Episode, Step, Update
from shared.db.session import session_scope
from shared.schemas import RunConfig
from tests.e2e.helpers import tiny_run

pytestmark = pytest.mark.slow


def _run(cfg: RunConfig) -> int:
    """A run with no corrector (neither algorithm sends steps to one)."""
    with session_scope() as s:
        run_id = create_run(s, cfg, "turbo-test").id
    driver = RunDriver(run_id, EnvPool(), InProcessPolicy(cfg.model), None, InProcessTrainer())
    assert driver.run() == "completed"
    return run_id


def _config(
    checkpoint: Path, envs: int, steps: int, updates: int = 2, **changes: object
) -> RunConfig:
    raw = tiny_run(checkpoint, changes, envs=envs, steps=steps, updates=updates)
    raw["metrics"]["probe_states"] = 2
    return RunConfig.model_validate(raw)


def test_grpo_and_gtr_turbo_kl(pg_url: str, warm_checkpoint: Path) -> None:
    # grpo by steps (the older rollout): 4 envs in groups of 2; no value loss, no corrector.
    cfg = _config(
        warm_checkpoint,
        4,
        4,
        algorithm="grpo",
        env={"max_episode_steps": 2},  # episodes end inside the rollout: complete groups
        train={"group_size": 2, "grpo_rollout": "steps"},
    )
    run_id = _run(cfg)
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
        assert not s.scalars(select(Correction.id).where(Correction.run_id == run_id)).all()

    # grpo by whole episodes (the default): the env's step cap (3), as every other arm's and
    # the evaluation's, not num_steps (1); a rollout ends once every env's first episode ended,
    # and those alone form the groups (all complete) and are trained.
    cfg = _config(
        warm_checkpoint,
        4,
        1,
        algorithm="grpo",
        env={"max_episode_steps": 3},
        train={"group_size": 2},
    )
    run_id = _run(cfg)
    longest = 0
    with session_scope() as s:
        metrics = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
        assert all(m["grpo/groups"] == 2 and m["grpo/episodes"] == 4 for m in metrics), metrics
        assert all(0.0 <= m["grpo/zero_adv_frac"] <= 1.0 for m in metrics)
        for u in (0, 1):
            firsts = s.scalars(
                select(Episode)
                .where(Episode.run_id == run_id, Episode.update_idx == u)
                .order_by(Episode.env_index, Episode.seq)
            ).all()
            lengths, whole = {}, {}
            for e in firsts:
                lengths.setdefault(e.env_index, e.length)
                whole.setdefault(e.env_index, e.finished)
            steps = s.scalars(
                select(Step.idx).where(Step.run_id == run_id, Step.update_idx == u)
            ).all()
            # Every env's first episode is whole (at most 3 steps), and the rollout lasted as
            # long as the longest of them.
            assert sorted(lengths) == [0, 1, 2, 3] and all(1 <= n <= 3 for n in lengths.values())
            assert all(whole.values())
            assert len(steps) == 4 * max(lengths.values())
            # Only the grouped episodes' steps train: the leftovers would dilute the mean.
            assert metrics[u]["grpo/trained_steps"] == sum(lengths.values())
            longest = max(longest, *lengths.values())
    assert longest > cfg.train.num_steps  # the step cap was the env's, not num_steps

    # gtr_turbo_kl: no corrector; the KL to the merged teacher is a loss on the thought tokens.
    # The teacher leaves out the acting policy (teacher.lag = 1): update 0 is taught by the
    # warm start that sampled it, update 1 by the warm start too, update 2 by checkpoint 0.
    # At lr 1e-4 (not the tiny runs' 1e-3, under which this run's sampled outputs stop being
    # well-formed by update 2, leaving no thought token to measure the KL on) the policy keeps
    # writing formed thoughts, whatever the float rounding of the draw.
    run_id = _run(
        _config(warm_checkpoint, 4, 2, updates=3, algorithm="gtr_turbo_kl", train={"lr": 1e-4})
    )
    with session_scope() as s:
        metrics = s.scalars(
            select(Update.metrics).where(Update.run_id == run_id).order_by(Update.idx)
        ).all()
        assert [m["turbo/teacher_newest_update"] for m in metrics] == [-1.0, -1.0, 0.0]
        assert [m["turbo/teacher_checkpoints"] for m in metrics] == [0.0, 0.0, 1.0]
        assert all(m["turbo/malformed_frac"] < 1.0 for m in metrics), metrics
        assert all("losses/kl" in m for m in metrics), metrics
        # The same weights score alike to float rounding; an older teacher does not.
        kl = [m["turbo/kl_mean"] for m in metrics]
        assert kl[0] < 1e-5 and kl[1] > 1e-5 and kl[2] > 1e-5, kl
        assert not s.scalars(select(Correction.id).where(Correction.run_id == run_id)).all()
        # The study report's column: the mean over the run's updates of the KL term's share
        # (the arm has no thought-SFT term: no SFT column).
        curves = report._curves(s, [run_id])
    shares = [m[report.KL_SHARE] for m in metrics if report.KL_SHARE in m]
    assert len(shares) == len(metrics) and all(0 <= v <= 1 for v in shares), shares
    got = report.term_share([run_id], curves, report.KL_SHARE)
    assert got == pytest.approx(sum(shares) / len(shares))
    assert report.term_share([run_id], curves, report.SFT_SHARE) is None


def test_gtr_turbo_sft_mode_corrects_a_rollout_step_in_one_batch(
    pg_url: str, warm_checkpoint: Path
) -> None:
    """GTR-Turbo's SFT mode embedded: the self-teacher answers each rollout step's steps in one
    batched decode, and those answers are the ones it gives one step at a time."""
    from services.controller.backends import ThreadCorrections
    from services.corrector.self_teacher import SelfTeacherCorrector
    from services.corrector.service import request_for_step
    from shared.settings import get_settings
    from shared.storage import blob_store

    # A small lr keeps update 1's policy writing JSON, so update 1 has steps to correct.
    changes = {"corrector": {"backend": "self_teacher"}, "train": {"lr": 1e-5}}
    cfg = _config(warm_checkpoint, 4, 2, **changes)
    with session_scope() as s:
        run_id = create_run(s, cfg, "turbo-sft").id
    c = cfg.corrector  # the embedded default's corrections: a thread pool in this process
    corrections = ThreadCorrections(c.name, c.noise, cfg.seed, get_settings(), run_id=run_id)
    policy = InProcessPolicy(cfg.model)
    driver = RunDriver(run_id, EnvPool(), policy, corrections, InProcessTrainer())
    assert driver.run() == "completed"
    with session_scope() as s:
        rows = s.execute(
            select(Correction, Step.update_idx, Step.rollout_pos)
            .join(Step, Step.id == Correction.step_id)
            .where(Correction.run_id == run_id)
        ).all()
        sent = s.scalars(select(Step.id).where(Step.run_id == run_id, Step.format_valid)).all()
        assert sorted(c.step_id for c, _, _ in rows) == sorted(sent)  # every well-formed step
        assert {u for _, u, _ in rows} == {0, 1}
        assert all(c.corrector == "self_teacher" for c, _, _ in rows)
        assert all(c.tokens == 0 and c.status in ("done", "failed") for c, _, _ in rows)
        # One decode per rollout step: its corrections share that batch's time equally.
        latency: dict[tuple[int, int], set[float]] = {}
        for c, u, pos in rows:
            if c.status == "done":  # rollout_pos = t * envs + e
                latency.setdefault((u, pos // 4), set()).add(round(c.latency_ms, 6))
        assert latency and all(len(v) == 1 for v in latency.values()), latency

        teacher = SelfTeacherCorrector(run_id, cfg)
        steps = s.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.id)).all()
        reqs = [request_for_step(s, st, blob_store()) for st in steps]
    batched = teacher.correct_many(reqs, [None] * len(reqs))
    for req, many in zip(reqs, batched, strict=True):
        try:
            one = teacher.correct(req)
        except Exception as e:  # noqa: BLE001 - then the batch failed that step the same way
            assert isinstance(many, type(e)) and str(many) == str(e)
            continue
        assert not isinstance(many, Exception), many
        assert (many.verdict, many.corrected_thought) == (one.verdict, one.corrected_thought)
        assert many.extras["teacher_checkpoint_ids"] == one.extras["teacher_checkpoint_ids"]
    assert teacher.cache.ids  # the run's checkpoints were merged: a trained teacher answered
