"""Writes what a rollout produced into the store: episodes, steps (images once, as blobs)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from shared.db.models import Correction, Episode, Step, Update
from shared.storage import BlobStore


def png_bytes(image: Any) -> bytes:
    """Lossless and deterministic, so the same frame always hashes to the same blob."""
    img = (
        image
        if isinstance(image, Image.Image)
        else Image.fromarray(np.asarray(image, dtype=np.uint8))
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


@dataclass
class EpisodeCursor:
    """The open episode of one env: its row id and running totals."""

    episode_id: int
    seq: int
    length: int = 0
    total_return: float = 0.0
    corrected: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def open_episode(
    session: Session,
    run_id: int,
    env_index: int,
    seq: int,
    update_idx: int,
    meta: dict | None = None,
) -> EpisodeCursor:
    row = Episode(
        run_id=run_id, env_index=env_index, seq=seq, update_idx=update_idx, meta=meta or {}
    )
    session.add(row)
    session.flush()
    return EpisodeCursor(row.id, seq, meta=meta or {})


def close_episode(session: Session, cursor: EpisodeCursor, success: bool) -> None:
    session.execute(
        update(Episode)
        .where(Episode.id == cursor.episode_id)
        .values(
            length=cursor.length, total_return=cursor.total_return, success=success, finished=True
        )
    )


def touch_episode(session: Session, cursor: EpisodeCursor) -> None:
    session.execute(
        update(Episode)
        .where(Episode.id == cursor.episode_id)
        .values(length=cursor.length, total_return=cursor.total_return)
    )


def add_step(session: Session, blobs: BlobStore, **values: Any) -> Step:
    """A step row; its image (the model's input) and display frame (for people) become blobs,
    each stored once by hash. Without a display frame, the step page draws one from the state."""
    image, display_png = values.pop("image", None), values.pop("display_png", None)
    values["image_sha"] = blobs.put(png_bytes(image)) if image is not None else None
    values["display_sha"] = blobs.put(display_png) if display_png else None
    row = Step(**values)
    session.add(row)
    return row


def discard_after(session: Session, run_id: int, update_idx: int) -> int:
    """Resume: forget what an interrupted rollout wrote past the last trained update."""
    step_ids = select(Step.id).where(Step.run_id == run_id, Step.update_idx > update_idx)
    session.execute(delete(Correction).where(Correction.step_id.in_(step_ids)))
    n = session.execute(  # type: ignore[attr-defined]
        delete(Step).where(Step.run_id == run_id, Step.update_idx > update_idx)
    ).rowcount
    session.execute(
        delete(Episode).where(Episode.run_id == run_id, Episode.update_idx > update_idx)
    )
    session.execute(delete(Update).where(Update.run_id == run_id, Update.idx > update_idx))
    # Episodes left open by the interruption are closed as unfinished: their envs are gone.
    session.execute(
        update(Episode)
        .where(Episode.run_id == run_id, Episode.finished.is_(False))
        .values(finished=True, success=None, meta={"abandoned": True})
    )
    return int(n or 0)


def abandon_episodes(session: Session, cursors: list[EpisodeCursor]) -> None:
    """Episodes cut off on purpose (grpo restarts its env groups every rollout): one with steps
    is closed as unfinished and marked abandoned; one that never got a step is dropped."""
    empty = [c.episode_id for c in cursors if c.length == 0]
    cut = [c.episode_id for c in cursors if c.length > 0]
    if empty:
        session.execute(delete(Episode).where(Episode.id.in_(empty)))
    if cut:
        session.execute(
            update(Episode)
            .where(Episode.id.in_(cut))
            .values(finished=True, success=None, meta={"abandoned": True})
        )


def close_cut_off(session: Session, run_id: int) -> None:
    """The run ended with episodes still open: they are finished, neither won nor lost, and
    marked, so the trace browser says 'cut off' rather than 'running' forever."""
    session.execute(
        update(Episode)
        .where(Episode.run_id == run_id, Episode.finished.is_(False))
        .values(finished=True, success=None, meta={"cut_off": True})
    )
