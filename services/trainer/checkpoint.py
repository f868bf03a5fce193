"""Checkpoints: policy weights + value head (the policy's own ``save``), optimiser, scheduler,
RNG states and update index, in ``checkpoint_store().path_for(run_id, update_idx)``, with a
``checkpoints`` row (size, sha256). A checkpoint is written to a temporary folder and renamed,
so a reader never sees half of one.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.db.models import Checkpoint

if TYPE_CHECKING:
    from services.policy.service import Policy
    from services.trainer.service import Trainer
from shared.storage import CheckpointStore, checkpoint_store

STATE_FILE = "trainer_state.pt"


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Everything but the weights that an exact resume needs."""
    return {
        "update_idx": trainer.update_idx,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "numpy_rng": trainer.rng.bit_generator.state,
        "torch_gen": trainer.torch_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def restore_trainer_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Inverse of ``trainer_state`` (weights are loaded separately, by the policy)."""
    trainer.update_idx = int(state["update_idx"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.rng.bit_generator.state = state["numpy_rng"]
    trainer.torch_gen.set_state(state["torch_gen"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])


def write_checkpoint(policy: Policy, path: Path, state: dict[str, Any] | None) -> Path:
    """Write weights (and the trainer state, if any) to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        policy.save(tmp)
        if state is not None:
            torch.save(state, tmp / STATE_FILE)
        if path.exists():  # a retried task rewrites the same update: replace it whole
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_checkpoint(session: Session, trainer: Trainer, run_id: int) -> Checkpoint:
    """Checkpoint the trainer at its update index and upsert the ``checkpoints`` row."""
    return record_checkpoint(
        session, run_id, trainer.update_idx, trainer.policy, trainer_state(trainer)
    )


def record_checkpoint(
    session: Session, run_id: int, update_idx: int, policy: Policy, state: dict[str, Any] | None
) -> Checkpoint:
    """Write a checkpoint folder and upsert its row; state None = weights only (the init)."""
    path = write_checkpoint(policy, checkpoint_store().path_for(run_id, update_idx), state)
    return record_folder(session, run_id, update_idx, path)


def record_folder(session: Session, run_id: int, update_idx: int, path: Path) -> Checkpoint:
    """Upsert the row of a checkpoint folder already in place (size and sha256 of its files)."""
    store = checkpoint_store()
    size, sha = CheckpointStore.digest(path)
    row = get_checkpoint(session, run_id, update_idx)
    if row is None:
        row = Checkpoint(run_id=run_id, update_idx=update_idx)
        session.add(row)
    row.path, row.size_bytes, row.sha256 = store.relative(path), size, sha
    session.flush()
    return row


def get_checkpoint(session: Session, run_id: int, update_idx: int) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.update_idx == update_idx)
    )


def latest_checkpoint(session: Session, run_id: int) -> Checkpoint | None:
    """The run's checkpoint with the highest update index (the init one is −1)."""
    return session.scalar(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.update_idx.desc())
        .limit(1)
    )


def checkpoint_path(row: Checkpoint) -> Path:
    return checkpoint_store().resolve(row.path)


def load_checkpoint(trainer: Trainer, path: Path) -> None:
    """Load weights into the trainer's policy and, when present, the trainer state."""
    trainer.policy.load_weights(path)
    state_file = Path(path) / STATE_FILE
    if state_file.exists():
        state = torch.load(state_file, weights_only=True)
        restore_trainer_state(trainer, state)
