"""The trainer's work on a run: ``run_init`` (the warm start, or a given checkpoint) and
``run_update`` (one update on a stored rollout), plain functions over a session.

The embedded mode calls them directly; the Celery tasks (``tasks.py``) and the data-parallel
launch (``distributed.py``) wrap them in a transaction. Both are idempotent: an update whose
checkpoint row exists, or whose update row is marked trained, returns at once, so a redelivered
task never trains twice. The loaded Trainer and DAgger buffer stay cached per run in the worker
process between updates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.db.models import Run, Update
from shared.rollout import Rollout
from shared.schemas import RunConfig
from shared.storage import blob_store

if TYPE_CHECKING:
    from services.policy.teacher import TeacherCache
    from services.trainer.buffer import DaggerBuffer
    from services.trainer.service import Trainer

log = logging.getLogger(__name__)

# Set in updates.metrics in the same transaction as the checkpoint.
TRAINED_KEY = "trained"


@dataclass
class RunState:
    trainer: Trainer
    buffer: DaggerBuffer
    config: RunConfig
    teachers: TeacherCache | None = None  # gtr_turbo_kl's merged self-teacher


_RUNS: dict[int, RunState] = {}
MAX_CACHED_RUNS = 2  # a trainer worker holds a model per cached run: keep the latest few


class UpdateError(RuntimeError):
    pass


def run_init(session: Session, run_id: int) -> dict[str, Any]:
    """The init stage: warm start (or a given checkpoint) → the run's checkpoint −1."""
    from services.trainer.checkpoint import get_checkpoint, record_checkpoint, record_folder
    from services.trainer.warmcache import cached_init_policy, reuse_checkpoint

    if get_checkpoint(session, run_id, -1) is not None:
        log.info("run %s is already initialised: skipping", run_id)
        return {"skipped": True}
    from shared.storage import CheckpointStore, checkpoint_store

    # Under LoRA the warm-started model becomes the run's own base, kept beside its checkpoints.
    path = checkpoint_store().path_for(run_id, -1)
    base_dir = path.parent / "base"
    cfg = _run_config(session, run_id)
    summary: dict[str, Any] = {}
    warm = reuse_checkpoint(cfg, path)  # full fine-tuning: the cached weights, no model built
    if warm is not None:
        record_folder(session, run_id, -1, path)
    else:
        from shared.phase import warm_progress, warm_start_reporter

        hook = warm_progress.set(warm_start_reporter(run_id))  # shows k of n; stops if cancelled
        try:
            policy, summary, warm = cached_init_policy(cfg, base_dir)
        finally:
            warm_progress.reset(hook)
        record_checkpoint(session, run_id, -1, policy, None)
    run = session.get(Run, run_id)
    assert run is not None
    # What the run starts from, by content: a study's arms of one seed compare fairly only from
    # the same weights (services/study/report.py checks it; a study bundle carries it).
    start: dict[str, Any] = {"init_weights_sha256": CheckpointStore.weights_digest(path, base_dir)}
    if warm is not None:  # the run record says whether the warm start came from the cache
        start["warm_start"] = warm.as_dict()
    run.info = {**(run.info or {}), **start}
    session.flush()
    return summary


def run_update(
    session: Session, run_id: int, update_idx: int, accelerator: Any = None
) -> dict[str, Any]:
    """Train update ``update_idx`` of a run on its stored rollout; checkpoint; record metrics.

    With an ``accelerator`` of several processes every rank trains its share of each minibatch
    and only the main process writes the checkpoint and the metrics.
    """
    from services.trainer.checkpoint import get_checkpoint, save_checkpoint

    main = accelerator is None or accelerator.is_main_process
    row = _update_row(session, run_id, update_idx, lock=accelerator is None)
    if row.metrics.get(TRAINED_KEY) or get_checkpoint(session, run_id, update_idx) is not None:
        log.info("run %s update %s already trained: skipping", run_id, update_idx)
        return {"skipped": True}
    state = _catch_up(session, run_id, update_idx, accelerator)
    _prepare(session, run_id, update_idx, state)
    metrics = _train(session, state, load_rollout(row))
    if state.teachers is not None:  # which checkpoints the KL teacher merged
        merged = state.teachers.updates or []
        metrics["turbo/teacher_checkpoints"] = float(len(merged))
        metrics["turbo/teacher_newest_update"] = float(max(merged, default=-1))
    cfg = state.config.train
    if main and (update_idx % cfg.checkpoint_every == 0 or update_idx >= cfg.num_updates - 1):
        ckpt = save_checkpoint(session, state.trainer, run_id)
        metrics["checkpoint_id"] = ckpt.id
    if main:
        row.metrics = {**row.metrics, **metrics, TRAINED_KEY: True}
        session.flush()
    return metrics


def load_rollout(row: Update) -> Rollout:
    """The rollout blob the controller named in ``updates.metrics["rollout_sha"]``."""
    sha = (row.metrics or {}).get("rollout_sha")
    if not sha:
        raise UpdateError(f"update {row.idx} of run {row.run_id} has no rollout_sha")
    return Rollout.from_bytes(blob_store().get(sha))


def _update_row(session: Session, run_id: int, update_idx: int, lock: bool = False) -> Update:
    # FOR UPDATE: a redelivered copy running at the same time waits, then sees "trained".
    query = select(Update).where(Update.run_id == run_id, Update.idx == update_idx)
    row = session.scalar(query.with_for_update() if lock else query)
    if row is None:
        raise UpdateError(f"run {run_id} has no update row {update_idx}")
    return row


def _catch_up(session: Session, run_id: int, update_idx: int, accelerator: Any = None) -> RunState:
    """The run's trainer at update_idx − 1: cached, else the latest checkpoint + replays."""
    from services.trainer.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint

    state = _RUNS.get(run_id)
    if (
        state is not None
        and state.trainer.accelerator is accelerator
        and (state.trainer.update_idx == update_idx - 1)
    ):
        return state
    ckpt = latest_checkpoint(session, run_id)
    if ckpt is None or ckpt.update_idx >= update_idx:
        raise UpdateError(f"run {run_id}: no checkpoint to start update {update_idx} from")
    state = _build_state(session, run_id, checkpoint_path(ckpt), accelerator)
    load_checkpoint(state.trainer, checkpoint_path(ckpt))
    state.trainer.update_idx = ckpt.update_idx
    _RUNS.pop(run_id, None)
    while len(_RUNS) >= MAX_CACHED_RUNS:
        _RUNS.pop(next(iter(_RUNS)))
    _RUNS[run_id] = state
    # Updates trained since that checkpoint (checkpoint_every > 1) are replayed from their blobs.
    for k in range(ckpt.update_idx + 1, update_idx):
        log.info("run %s: replaying update %s", run_id, k)
        _prepare(session, run_id, k, state)
        _train(session, state, load_rollout(_update_row(session, run_id, k)))
    return state


def _train(session: Session, state: RunState, rollout: Rollout) -> dict[str, Any]:
    """One trainer update on a rollout, with the corrector's verdicts when a reward needs them."""
    from services.trainer.buffer import judged_correct

    judged = None
    if state.config.train.judge_reward:
        judged = judged_correct(session, rollout.step_ids)
    return dict(state.trainer.update(rollout, state.buffer, judged))


def _prepare(session: Session, run_id: int, update_idx: int, state: RunState) -> None:
    """Before training an update: the DAgger buffer refreshed; under gtr_turbo_kl the merged
    self-teacher of the checkpoints written before this update."""
    state.buffer.refresh(session)
    if state.config.algorithm != "gtr_turbo_kl":
        return
    from services.policy.teacher import TeacherCache, run_checkpoints

    if state.teachers is None:
        state.teachers = TeacherCache(state.config.teacher)
    refs = run_checkpoints(session, run_id, before=update_idx)
    state.trainer.teacher = state.teachers.get(refs)
    state.trainer.turbo = state.config.teacher


def _run_config(session: Session, run_id: int) -> RunConfig:
    run = session.get(Run, run_id)
    if run is None:
        raise UpdateError(f"run {run_id} does not exist")
    return RunConfig.model_validate(run.config)


def _build_state(
    session: Session, run_id: int, checkpoint_dir: Any, accelerator: Any = None
) -> RunState:
    """A fresh trainer on the base model the checkpoint names (its weights are loaded after)."""
    from services.policy.checkpoint import read_checkpoint_meta
    from services.policy.service import Policy
    from services.trainer.buffer import DaggerBuffer
    from services.trainer.service import Trainer

    cfg = _run_config(session, run_id)
    base = read_checkpoint_meta(checkpoint_dir)["base_model"]
    policy = Policy.from_config(cfg.model, base, seed=cfg.seed)
    trainer = Trainer(
        policy, cfg.train, cfg.algorithm, cfg.generation, seed=cfg.seed, accelerator=accelerator
    )
    buffer = DaggerBuffer(run_id, cfg.train.dagger_sampling, cfg.train.sft_target)
    return RunState(trainer, buffer, cfg)


def forget_run(run_id: int) -> None:
    """Drop a run's cached trainer (after a failure its in-memory state can't be trusted)."""
    _RUNS.pop(run_id, None)
