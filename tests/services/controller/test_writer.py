"""The batched recorder: one transaction per rollout step, the same rows the per-step path wrote."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select, update

from services.api.service import create_run
from services.controller.recorder import open_episode, png_bytes
from services.controller.writer import FrameShas, StepRecord, WritePipeline, record_step_batch
from shared.db.models import Episode, Run, Step
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.storage import blob_store


def _record(env: int, t: int, frame: np.ndarray, done: bool = False, reward: float = 0.5):
    columns = {
        "update_idx": 0,
        "rollout_pos": t * 2 + env,
        "prompt": "p <b>'\"",
        "output": "o\x00",  # model text may hold NUL (PostgreSQL text refuses it)
        "thought": "th",
        "action_text": '"+"',
        "parsed_action": "+",
        "format_valid": True,
        "action_valid": True,
        "reward": reward,
        "done": done,
        "value": 0.1,
        "logprob": -1.0,
        "thought_entropy": None,
        "state": {"current": t},
    }
    return StepRecord(env, frame, columns, done, True if done else None, {"x": 1} if done else None)


@pytest.fixture(params=["postgresql", "sqlite"])
def store_url(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path) -> str:
    """Both stores: PostgreSQL takes the COPY / unnest path, SQLite the INSERT ... RETURNING one."""
    if request.param == "postgresql":
        return pg_url
    from shared.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'writer.sqlite3'}"
    upgrade(url)
    return url


def test_a_rollout_step_of_every_env_is_written_with_its_episodes(store_url: str) -> None:
    url = store_url
    frames = [np.full((8, 8, 3), i * 40, dtype=np.uint8) for i in range(2)]
    with session_scope(url) as s:
        run = create_run(s, RunConfig(task="numberline"), "writer-test")
        cursors = [open_episode(s, run.id, e, 0, 0) for e in range(2)]
    blobs = blob_store()
    shas = FrameShas(blobs)
    ended: list[tuple[int, bool, dict]] = []

    def on_end(cur, ok, final) -> None:  # type: ignore[no-untyped-def]
        ended.append((cur.length, ok, final))

    ids_all = []
    for t in range(3):
        # env 1 finishes its episode at t=1; env 0 never does
        records = [_record(0, t, frames[0]), _record(1, t, frames[1], done=t == 1, reward=1.0)]
        with session_scope(url) as s:
            ids, frame_shas, cancel = record_step_batch(
                s, run.id, 0, records, cursors, shas, on_end
            )
        assert not cancel and len(ids) == 2 and ids == sorted(ids)
        assert frame_shas == [blobs.put(png_bytes(frames[0])), blobs.put(png_bytes(frames[1]))]
        ids_all += ids
    with session_scope(url) as s:
        steps = s.scalars(select(Step).where(Step.run_id == run.id).order_by(Step.id)).all()
        episodes = s.scalars(
            select(Episode).where(Episode.run_id == run.id).order_by(Episode.env_index, Episode.seq)
        ).all()
        env_steps = s.scalar(select(Run.env_steps).where(Run.id == run.id))
    assert [st.id for st in steps] == ids_all
    positions = [(st.rollout_pos, st.idx) for st in steps]
    assert positions == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 0)]
    assert steps[0].prompt == "p <b>'\"" and steps[0].state == {"current": 0}
    assert steps[0].output == "o\ufffd"
    assert env_steps == 6
    e0, e1_first, e1_next = episodes
    assert (e0.length, e0.total_return, e0.finished) == (3, 1.5, False)
    assert (e1_first.length, e1_first.total_return, e1_first.success, e1_first.finished) == (
        2, 2.0, True, True,
    )  # fmt: skip
    assert (e1_next.seq, e1_next.length, e1_next.finished) == (1, 1, False)
    assert steps[5].episode_id == e1_next.id
    assert ended == [(2, True, {"x": 1})]
    # The cancel flag comes back with the next write.
    with session_scope(url) as s:
        s.execute(update(Run).where(Run.id == run.id).values(cancel_requested=True))
    with session_scope(url) as s:
        *_, cancel = record_step_batch(s, run.id, 0, [_record(0, 3, frames[0])], cursors, shas)
    assert cancel


def test_the_write_pipeline_keeps_order_and_raises_a_failure_in_the_caller() -> None:
    seen: list[int] = []
    gate = threading.Event()

    def job(i: int) -> int:
        gate.wait(5)
        if i == 2:
            raise RuntimeError("database gone")
        seen.append(i)
        return i * 10

    with WritePipeline() as pipe:
        for i in range(2):
            pipe.submit(job, i)
        gate.set()
        assert pipe.results() == [0, 10]
        pipe.submit(job, 2)
        pipe.submit(job, 3)  # queued behind the failing one: skipped
        with pytest.raises(RuntimeError, match="database gone"):
            pipe.results()
        with pytest.raises(RuntimeError, match="database gone"):
            pipe.submit(job, 4)
    assert seen == [0, 1]


def test_the_recorder_and_a_corrector_worker_lock_episodes_in_one_order(pg_url: str) -> None:
    """While a corrector worker's transaction holds one episode, the recorder waits for it
    holding none, and the worker then takes the other without waiting. (The recorder once locked
    them in its envs' order: this interleaving was a deadlock PostgreSQL broke by failing one.)"""
    from sqlalchemy import text

    from services.corrector.service import _count_corrected_many

    frames = [np.full((8, 8, 3), i * 40, dtype=np.uint8) for i in range(2)]
    with session_scope(pg_url) as s:
        run = create_run(s, RunConfig(task="numberline"), "lock-order")
        cursors = [open_episode(s, run.id, e, 0, 0) for e in range(2)]
    shas = FrameShas(blob_store())
    with session_scope(pg_url) as s:
        first, _, _ = record_step_batch(
            s, run.id, 0, [_record(0, 0, frames[0]), _record(1, 0, frames[1])], cursors, shas
        )
    with session_scope(pg_url) as s:
        steps = {st.id: st for st in s.scalars(select(Step).where(Step.id.in_(first)))}
        s.expunge_all()
    low, high = (steps[i] for i in first)  # env 0's episode has the lower id
    assert low.episode_id < high.episode_id

    def incorrect(step: Step) -> list[dict]:
        return [{"step_id": step.id, "status": "done", "verdict": "incorrect"}]

    failures: list[BaseException] = []

    def recorder() -> None:  # the next rollout step, its envs in the other order
        try:
            with session_scope(pg_url) as s:
                records = [_record(1, 1, frames[1]), _record(0, 1, frames[0])]
                record_step_batch(s, run.id, 0, records, cursors, shas)
        except BaseException as e:  # noqa: BLE001 - the assertion below names it
            failures.append(e)

    with session_scope(pg_url) as worker:
        worker.execute(text("SET LOCAL lock_timeout = '10s'"))
        _count_corrected_many(worker, {low.id: low}, incorrect(low), {low.id})
        thread = threading.Thread(target=recorder)
        thread.start()
        for _ in range(200):  # until the recorder waits on the worker's lock
            # A transaction of its own per look: pg_stat_activity is a snapshot per transaction.
            with session_scope(pg_url) as probe:
                waiting = probe.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'"
                    )
                )
            if waiting:
                break
            threading.Event().wait(0.05)
        assert waiting, "the recorder never waited on the worker's episode"
        _count_corrected_many(worker, {high.id: high}, incorrect(high), {high.id})
    thread.join(30)
    assert not failures, failures
    with session_scope(pg_url) as s:
        counted = s.scalars(
            select(Episode.corrected_steps).where(Episode.run_id == run.id).order_by(Episode.id)
        ).all()
        assert counted == [1, 1]
        assert s.scalar(select(Run.env_steps).where(Run.id == run.id)) == 4
