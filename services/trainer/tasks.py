"""The trainer worker: ``trainer.update(run_id, update_idx)`` on queue ``trainer``.

``run_update`` holds the logic; the embedded mode calls it directly and the Celery task wraps it
in a transaction. It is idempotent: an update whose checkpoint row exists, or whose update row is
marked trained, returns at once, so a redelivered task never trains twice. The loaded Trainer and
DAgger buffer stay cached per run in the worker process between updates.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from shared.db.models import Run, Update
from shared.logs import run_context
from shared.queues import TASK_INIT, TASK_UPDATE, celery_app
from shared.rollout import Rollout
from shared.schemas import RunConfig
from shared.storage import blob_store

log = logging.getLogger(__name__)

# Set in updates.metrics in the same transaction as the checkpoint.
TRAINED_KEY = "trained"
# An accelerate config file: set on a multi-GPU trainer pod to run each update data-parallel.
ACCELERATE_ENV = "GTR_TRAINER_ACCELERATE_CONFIG"
# Seconds between a running task's beats (``_beating``); the controller's lost_after_s is larger.
BEAT_S = 2.0


@dataclass
class RunState:
    trainer: Any  # services.trainer.service.Trainer
    buffer: Any  # services.trainer.buffer.DaggerBuffer
    config: RunConfig
    teachers: Any = None  # services.trainer.teacher.TeacherCache (gtr_turbo_kl)


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
    from shared.storage import checkpoint_store

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
    if warm is not None:  # the run record says whether the warm start came from the cache
        run = session.get(Run, run_id)
        assert run is not None
        run.info = {**(run.info or {}), "warm_start": warm.as_dict()}
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
    from services.trainer.teacher import TeacherCache, run_checkpoints

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


@contextmanager
def _beating(task: Any, every_s: float = BEAT_S) -> Iterator[None]:
    """While a task runs, a thread rewrites its STARTED state with a new beat: the controller
    tells a worker at work from a killed one by it (a busy solo worker answers no broadcast)."""
    stop = threading.Event()
    task_id = task.request.id  # the request is thread-local: read it here, not in the thread

    def beat() -> None:
        n = 0
        while not stop.wait(every_s):
            n += 1
            try:
                task.update_state(task_id, "STARTED", {"pid": os.getpid(), "beat": n})
            except Exception:  # Redis restarting: the next beat lands in the new one
                log.debug("beat of task %s failed", task_id, exc_info=True)

    thread = threading.Thread(target=beat, name="beat", daemon=True)
    if task_id and not task.request.is_eager:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()  # a beat stored after the result would turn it back into STARTED


# The database away (a restart, a failover) fails the task's transaction: run it again after 1,
# 2, 4, ... 30 s, about 3 minutes in all; both tasks are idempotent, and the failed copy dropped
# its cached trainer. The controller reads RETRY as a task still held (or, past its
# lost_after_s, sends a copy, which finds the update trained or trains it once).
_TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "bind": True,
    "autoretry_for": (OperationalError,),
    "retry_backoff": True,
    "retry_backoff_max": 30,
    "retry_jitter": False,
    "max_retries": 10,
}


@celery_app.task(name=TASK_INIT, **_TASK_OPTIONS)
def init(self: Any, run_id: int) -> dict[str, Any]:
    """Celery entry point: one transaction around ``run_init``."""
    from shared.db.session import session_scope

    with _beating(self), run_context(run_id), session_scope() as session:
        return run_init(session, run_id)


@celery_app.task(name=TASK_UPDATE, **_TASK_OPTIONS)
def update(self: Any, run_id: int, update_idx: int) -> dict[str, Any]:
    """Celery entry point: one transaction around ``run_update``."""
    from shared.db.session import session_scope

    config_file = os.environ.get(ACCELERATE_ENV)
    try:
        with _beating(self):
            if config_file:  # several GPUs: one data-parallel job per update
                from services.trainer.distributed import launch

                return launch(run_id, update_idx, config_file)
            with run_context(run_id), session_scope() as session:
                return run_update(session, run_id, update_idx)
    except BaseException:
        forget_run(run_id)
        raise
