"""Recording a rollout off its critical path, one transaction per rollout step.

``record_step_batch`` writes what all envs of a run did in one rollout step with a handful of
statements whatever the number of envs. PostgreSQL: three (the new ids; the steps by ``COPY``;
one statement for the episodes' totals, the episodes that start and the run's counters, which
also reads its cancel flag). SQLite: a multi-row ``INSERT ... RETURNING`` for the steps and for
the episodes that start, an executemany ``UPDATE`` for the episodes, one for the run. The
per-step path it replaces made two or three round trips per env (an ``INSERT`` flushed for its
id, an episode ``UPDATE``), which the full stack paid to PostgreSQL on the rollout's critical
path.

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
from shared.db.bulk import copy_rows, insert_many
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
    totals, ended = _advance(records, cursors)
    new = [
        {"run_id": run_id, "env_index": e, "seq": cur.seq + 1, "update_idx": update_idx, "meta": {}}
        for e, cur, _, _ in ended
    ]
    run_set = {"env_steps": len(records), "heartbeat_at": utcnow(), **(run_values or {})}
    if s.get_bind().dialect.name == "postgresql":
        ids, opened, cancel = _write_pg(s, rows, totals, new, run_id, run_set)
    else:
        ids = insert_many(s, cast(Table, Step.__table__), rows)
        for batch in (
            [
                {k: t[k] for k in ("id", "length", "total_return")}
                for t in totals
                if not t["closed"]
            ],
            [{**t, "finished": True} for t in totals if t["closed"]],
        ):
            if batch:
                s.execute(
                    update(Episode), [{k: v for k, v in t.items() if k != "closed"} for t in batch]
                )
        opened = insert_many(s, cast(Table, Episode.__table__), new) if new else []
        steps = run_set.pop("env_steps")
        cancel = bool(
            s.scalar(
                update(Run)
                .where(Run.id == run_id)
                .values(env_steps=Run.env_steps + steps, **run_set)
                .returning(Run.cancel_requested)
            )
        )
    for (e, cur, success, final), eid in zip(ended, opened, strict=True):
        if on_episode_end is not None:
            on_episode_end(cur, success, final)
        cursors[e] = EpisodeCursor(eid, cur.seq + 1)
    return ids, [sha or "" for sha in shas], bool(cancel)


def _advance(
    records: list[StepRecord], cursors: list[EpisodeCursor]
) -> tuple[list[dict[str, Any]], list[tuple[int, EpisodeCursor, bool, dict[str, Any]]]]:
    """Move each env's open episode on by its step: the episodes' new running totals (``closed``
    and ``success`` for those that ended), and the ended ones (env, cursor, success, state)."""
    totals, ended = [], []
    for r in records:
        cur = cursors[r.env]
        cur.length += 1
        cur.total_return += float(r.columns["reward"])
        success = bool(r.success) if r.done else None
        totals.append(
            {
                "id": cur.episode_id,
                "length": cur.length,
                "total_return": cur.total_return,
                "success": success,
                "closed": r.done,
            }  # fmt: skip
        )
        if r.done:
            ended.append((r.env, cur, bool(success), r.final_state or {}))
    return totals, ended


# The episodes' totals, the episodes that start and the run's counter, in one statement.
_PG_EPISODES_AND_RUN = """
WITH moved AS (
  UPDATE episodes SET length = v.length, total_return = v.total_return,
    success = CASE WHEN v.closed THEN v.success ELSE episodes.success END,
    finished = episodes.finished OR v.closed
  FROM unnest(CAST(:id AS integer[]), CAST(:length AS integer[]), CAST(:total_return AS float8[]),
              CAST(:success AS boolean[]), CAST(:closed AS boolean[]))
       AS v(id, length, total_return, success, closed)
  WHERE episodes.id = v.id
), opened AS (
  INSERT INTO episodes (id, run_id, env_index, seq, update_idx, length, total_return, finished,
                        corrected_steps, meta)
  SELECT v.id, :run_id, v.env_index, v.seq, :update_idx, 0, 0.0, false, 0, CAST('{{}}' AS json)
  FROM unnest(CAST(:new_id AS integer[]), CAST(:new_env AS integer[]), CAST(:new_seq AS integer[]))
       AS v(id, env_index, seq)
)
UPDATE runs SET env_steps = env_steps + :env_steps{sets} WHERE id = :run_id
RETURNING cancel_requested
"""


def _write_pg(
    s: Session,
    rows: list[dict[str, Any]],
    totals: list[dict[str, Any]],
    new: list[dict[str, Any]],
    run_id: int,
    run_set: dict[str, Any],
) -> tuple[list[int], list[int], bool]:
    """PostgreSQL: a rollout step in three statements, the fewest round trips: the ids of the new
    steps and episodes (and this transaction's asynchronous commit) in one query, the steps by
    ``COPY``, then ``_PG_EPISODES_AND_RUN``. On a busy server each round trip costs more than the
    rows it carries."""
    # The open episodes are locked first, in id order: the corrector worker updates some of them
    # (their corrected_steps) in the same order, so the two never wait on each other in a cycle
    # (a deadlock that PostgreSQL ends by failing one of them; it failed a bench run).
    got = s.execute(
        text(
            "SELECT set_config('synchronous_commit', 'off', true), "
            "ARRAY(SELECT nextval(pg_get_serial_sequence('steps', 'id')) "
            "FROM generate_series(1, :n)), "
            "ARRAY(SELECT nextval(pg_get_serial_sequence('episodes', 'id')) "
            "FROM generate_series(1, :m)), "
            "ARRAY(SELECT id FROM episodes WHERE id = ANY(CAST(:moved AS integer[])) "
            "ORDER BY id FOR UPDATE)"
        ),
        {"n": len(rows), "m": len(new), "moved": [t["id"] for t in totals]},
    ).one()
    ids, opened = sorted(got[1]), sorted(got[2])
    copy_rows(
        s, cast(Table, Step.__table__), [{**r, "id": i} for r, i in zip(rows, ids, strict=True)]
    )
    params: dict[str, Any] = (
        {k: [t[k] for t in totals] for k in totals[0]}
        if totals
        else {k: [] for k in ("id", "length", "total_return", "success", "closed")}
    )
    params |= {
        "new_id": opened,
        "new_env": [n["env_index"] for n in new],
        "new_seq": [n["seq"] for n in new],
        "update_idx": new[0]["update_idx"] if new else 0,
        "run_id": run_id,
    }
    extra = {k: v for k, v in run_set.items() if k != "env_steps"}  # our own column names
    sets = "".join(f", {k} = :run_{k}" for k in extra)
    params |= {f"run_{k}": v for k, v in extra.items()} | {"env_steps": run_set["env_steps"]}
    cancel = s.scalar(text(_PG_EPISODES_AND_RUN.format(sets=sets)), params)
    return ids, opened, bool(cancel)


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
