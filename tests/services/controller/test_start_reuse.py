"""The start's evaluation is played once per start: a second arm from the same weights under the
same protocol takes the first one's outcomes (recorded as reused), and they are the outcomes
it would have played itself; another protocol plays its own; an arm that reaches its start while
a live sibling is playing it waits for that sibling's outcomes, and not for a dead one."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from services.controller import store
from services.controller.backends import InProcessPolicy, InProcessTrainer, checkpoint_dir
from services.controller.evaluate import START_UPDATE, DealOutcome, evaluate_deals
from services.controller.launch import create_run
from services.controller.service import RunDriver
from services.controller.start_eval import evaluate_start, start_key
from services.env import EnvPool
from shared.db.models import EvalOutcome, Run, Update, utcnow
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.seeds import eval_seed
from tests.e2e.helpers import tiny_run

TEAM = "start-reuse"  # runs of their own: no other file's run shares their start
DEALS = 3


def _config(checkpoint: Path, algorithm: str) -> RunConfig:
    changes = {"algorithm": algorithm, "train": {"group_size": 2}}
    raw = tiny_run(checkpoint, changes, envs=2, steps=2, updates=1)
    raw["metrics"] |= {"probe_states": 2, "eval_episodes": DEALS, "eval_every": 1}
    return RunConfig.model_validate(raw)


def _run(cfg: RunConfig) -> int:
    with session_scope() as s:
        run_id = create_run(s, cfg, TEAM).id
    driver = RunDriver(run_id, EnvPool(), InProcessPolicy(cfg.model), None, InProcessTrainer())
    assert driver.run() == "completed"
    return run_id


def _start(run_id: int) -> tuple[dict, list[DealOutcome], float]:
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None
        rows = s.scalars(
            select(EvalOutcome)
            .where(EvalOutcome.run_id == run_id, EvalOutcome.update_idx == START_UPDATE)
            .order_by(EvalOutcome.deal)
        ).all()
        first = s.scalar(select(Update.metrics).where(Update.run_id == run_id, Update.idx == 0))
        outcomes = [
            DealOutcome(r.deal, r.seed, r.success, r.episode_return, r.episode_length) for r in rows
        ]
        return dict(run.info["start_eval"]), outcomes, first["eval_start/reused"]


def test_the_arms_of_one_start_evaluate_it_once(pg_url: str, warm_checkpoint: Path) -> None:
    first = _run(_config(warm_checkpoint, "rl4vlm"))
    second_cfg = _config(warm_checkpoint, "grpo")  # another arm, the same start and protocol
    second = _run(second_cfg)
    played, outcomes, reused = _start(first)
    assert played["reused_from"] is None and reused == 0.0 and len(outcomes) == DEALS
    taken, copied, reused = _start(second)
    assert taken == {"key": played["key"], "reused_from": first, "done": True} and reused == 1.0
    assert copied == outcomes
    # What the second arm would have played itself from its start: the same outcomes.
    envs, policy = EnvPool(), InProcessPolicy(second_cfg.model)
    policy.load_weights(str(checkpoint_dir(second, -1)))
    assert evaluate_deals(envs, policy, second_cfg, DEALS) == outcomes
    # Another protocol (a longer token cap) is another evaluation: played, not taken.
    longer = second_cfg.model_copy(
        update={"generation": second_cfg.generation.model_copy(update={"max_new_tokens": 48})}
    )
    again = evaluate_start(second, envs, policy, longer, DEALS)
    assert again.reused_from is None and again.key not in (None, played["key"])
    assert start_key(longer, None) is None  # no recorded start digest: nothing to match on


def _claimant(cfg: RunConfig, sha: str, beat_s_ago: float) -> int:
    """A run that claimed the start (a second ago) and is playing it, its heartbeat so old."""
    with session_scope() as s:
        run = create_run(s, cfg, "start-wait")
        run.status, run.heartbeat_at = "running", utcnow() - timedelta(seconds=beat_s_ago)
        claim = {"key": start_key(cfg, sha), "claimed_at": time.time() - 1}
        run.info = {"init_weights_sha256": sha, "start_eval": claim}
        s.flush()
        return run.id


def _arm(cfg: RunConfig, sha: str) -> int:
    with session_scope() as s:
        run = create_run(s, cfg, "start-wait")
        run.info = {"init_weights_sha256": sha}
        s.flush()
        return run.id


def test_an_arm_waits_for_the_start_a_live_sibling_is_playing(
    pg_url: str, warm_checkpoint: Path
) -> None:
    cfg = _config(warm_checkpoint, "rl4vlm")
    sha = "5a" * 32  # the start weights' digest, as the trainer records it
    ahead, me = _claimant(cfg, sha, beat_s_ago=0), _arm(cfg, sha)
    # Outcomes no greedy play of these weights gives: taken, they can only be the sibling's.
    theirs = [DealOutcome(d, eval_seed(d), d == 1, 0.25 * d - 0.5, 7 + d) for d in range(DEALS)]

    def sibling_finishes() -> None:
        time.sleep(1.5)
        with session_scope() as s:
            store.record_eval_outcomes(s, ahead, START_UPDATE, theirs)
            run = store.run_row(s, ahead)
            run.info = {**run.info, "start_eval": {**run.info["start_eval"], "done": True}}

    envs, policy = EnvPool(), InProcessPolicy(cfg.model)
    policy.load_weights(str(warm_checkpoint))
    sibling = threading.Thread(target=sibling_finishes)
    sibling.start()
    got = evaluate_start(me, envs, policy, cfg, DEALS)
    sibling.join()
    assert got.reused_from == ahead and got.outcomes == theirs
    # A claimant whose heartbeat stopped (its process died) is not waited for: played here.
    dead, other = _claimant(cfg, "6b" * 32, beat_s_ago=600), _arm(cfg, "6b" * 32)
    got = evaluate_start(other, envs, policy, cfg, DEALS)
    assert got.reused_from is None and len(got.outcomes) == DEALS
    with session_scope() as s:
        assert store.run_row(s, other).info["start_eval"]["done"] is True
        assert "done" not in store.run_row(s, dead).info["start_eval"]
