"""Recording a rollout off its critical path, one transaction per rollout step.

``record_step_batch`` writes what all envs of a run did in one rollout step with a handful of
statements whatever the number of envs: one multi-row ``INSERT ... RETURNING`` for the steps, one
for the episodes that start, one executemany ``UPDATE`` for the open episodes' running totals,
one ``UPDATE`` of the run's counters (which also reads its cancel flag). The per-step path it
replaces made two or three round trips per env (an ``INSERT`` flushed for its id, an episode
``UPDATE``), which the full stack paid to PostgreSQL on the rollout's critical path.

``WritePipeline`` runs those writes on one background thread, in order, while the controller
generates the next step; the step ids come back when the rollout ends. Frames are stored once:
``FrameShas`` remembers the blob id of every distinct frame it has seen, so a frame seen again is
neither PNG-encoded nor hashed again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from sqlalchemy import Table, text, update
from sqlalchemy.orm import Session

from services.controller.recorder import EpisodeCursor, png_bytes
from shared.db.bulk import insert_many
from shared.db.models import Episode, Run, Step, utcnow
from shared.storage import BlobStore


class FrameShas:
    """Blob ids of frames by their pixels: a frame seen before costs one fast hash of its bytes.

    The blob id stays the sha256 of the frame's PNG (what ``add_step`` stores), so both paths
    name the same blob."""

    def __init__(self, blobs: BlobStore, capacity: int = 4096) -> None:
        self.blobs, self.capacity = blobs, capacity
        self._shas: OrderedDict[bytes, str] = OrderedDict()

    def sha(self, image: Any) -> str:
        arr = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
        key = hashlib.blake2b(arr.tobytes(), digest_size=16, person=str(arr.shape).encode()[:16])
        k = key.digest()
        sha = self._shas.get(k)
        if sha is None:
            sha = self._shas[k] = self.blobs.put(png_bytes(arr))
            if len(self._shas) > self.capacity:
                self._shas.popitem(last=False)
        else:
            self._shas.move_to_end(k)
        return sha


@dataclass
class StepRecord:
    """One env's step, as the writer needs it."""

    env: int  # index of the env within the run
    image: Any  # the frame the agent saw (None: no frame)
    columns: dict[str, Any]  # Step columns, without episode_id, idx, image_sha
    done: bool
    success: bool | None  # when done
    final_state: dict[str, Any] | None  # when done
    correct: bool = False  # queue it for correction once written
    display_png: bytes | None = None  # the frame for people (PNG); None: drawn when viewed


EpisodeEnd = Callable[[EpisodeCursor, bool, dict[str, Any]], None]


def record_step_batch(
    s: Session,
    run_id: int,
    update_idx: int,
    records: list[StepRecord],
    cursors: list[EpisodeCursor],
    frames: FrameShas,
    on_episode_end: EpisodeEnd | None = None,
    run_values: dict[str, Any] | None = None,
) -> tuple[list[int], list[str], bool]:
    """Write one rollout step of every env; moves the episode cursors on (a finished episode is
    closed and the env's next one opened). Returns the step ids and frame shas in ``records``'
    order, and whether the run was asked to cancel. ``run_values``: more columns of the run's row
    to set in the same ``UPDATE`` as its step counter.

    On PostgreSQL the transaction commits without waiting for its WAL flush (``synchronous_commit
    = off``, this transaction only): a commit costs a disk flush, tens of ms on a busy disk, per
    rollout step. Nothing of value can be lost: a crash loses at most the last fraction of a
    second of commits, all of them rollout steps past the last trained update, which a resumed
    run discards and collects again anyway (``recorder.discard_after``)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SET LOCAL synchronous_commit TO OFF"))
    shas = [frames.sha(r.image) if r.image is not None else None for r in records]
    rows = [
        {
            **r.columns,
            "run_id": run_id,
            "episode_id": cursors[r.env].episode_id,
            "idx": cursors[r.env].length,
            "image_sha": sha,
            # Only frames no state can redraw come here (THOR); the rest are drawn when viewed.
            "display_sha": frames.blobs.put(r.display_png) if r.display_png else None,
        }
        for r, sha in zip(records, shas, strict=True)
    ]
    ids = insert_many(s, cast(Table, Step.__table__), rows)
    touched, closed, ended = [], [], []
    for r in records:
        cur = cursors[r.env]
        cur.length += 1
        cur.total_return += float(r.columns["reward"])
        if r.done:
            success = bool(r.success)
            closed.append(
                {
                    "id": cur.episode_id,
                    "length": cur.length,
                    "total_return": cur.total_return,
                    "success": success,
                    "finished": True,
                }  # fmt: skip
            )
            ended.append((r.env, cur, success, r.final_state or {}))
        else:
            touched.append(
                {"id": cur.episode_id, "length": cur.length, "total_return": cur.total_return}
            )
    for batch in (touched, closed):
        if batch:
            update_episodes(s, batch)
    if ended:
        new = [
            {
                "run_id": run_id,
                "env_index": e,
                "seq": cur.seq + 1,
                "update_idx": update_idx,
                "meta": {},
            }  # fmt: skip
            for e, cur, _, _ in ended
        ]
        opened = insert_many(s, cast(Table, Episode.__table__), new)
        for (e, cur, success, final), eid in zip(ended, opened, strict=True):
            if on_episode_end is not None:
                on_episode_end(cur, success, final)
            cursors[e] = EpisodeCursor(eid, cur.seq + 1)
    cancel = s.scalar(
        update(Run)
        .where(Run.id == run_id)
        .values(env_steps=Run.env_steps + len(records), heartbeat_at=utcnow(), **(run_values or {}))
        .returning(Run.cancel_requested)
    )
    return ids, [sha or "" for sha in shas], bool(cancel)


def update_episodes(s: Session, rows: list[dict[str, Any]]) -> None:
    """Set episodes' running totals (and, for closed ones, success and finished) by id; rows
    share their keys. PostgreSQL: one statement over arrays (``unnest``), not one per row."""
    if s.get_bind().dialect.name != "postgresql":
        s.execute(update(Episode), rows)  # executemany by primary key
        return
    closing = "success" in rows[0]
    sets = "length = v.length, total_return = v.total_return"
    cols = "CAST(:id AS integer[]), CAST(:length AS integer[]), CAST(:total_return AS float8[])"
    names = "id, length, total_return"
    if closing:
        sets += ", success = v.success, finished = true"
        cols += ", CAST(:success AS boolean[])"
        names += ", success"
    keys = ("id", "length", "total_return", "success")[: 3 + closing]
    sql = f"UPDATE episodes SET {sets} FROM unnest({cols}) AS v({names}) WHERE episodes.id = v.id"
    s.execute(text(sql), {k: [r[k] for r in rows] for k in keys})


class WritePipeline:
    """Runs write jobs on one background thread, in submission order.

    A failed job's error is raised in the caller at its next ``submit`` or at ``results``, and
    the jobs queued after it are skipped: they would build on state the failed one left half-way
    (the caller abandons the rollout)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self._futures: list[Future[Any]] = []
        self._failed: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._failed is not None:
            raise self._failed
        self._futures.append(self._pool.submit(self._run, fn, *args))

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._failed is not None:
            raise RuntimeError("skipped: an earlier write of this rollout failed")
        try:
            return fn(*args)
        except BaseException as e:
            self._failed = e
            raise

    def results(self) -> list[Any]:
        """Every job's result, in order, once all are written (raises the first failure)."""
        return [f.result() for f in self._futures]

    def close(self) -> None:
        """Wait for the jobs still running (so the store is left consistent) and stop."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
