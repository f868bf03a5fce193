"""A corrector that answers late, behind a real local server: each correction has one outcome,
the stored row, and the log says what the row says; at the run's end the wait covers only what
is in flight, and what was never sent is recorded skipped at once."""

from __future__ import annotations

import json
import logging
import time

import pytest
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import (
    CorrectionSweep,
    ThreadCorrections,
    settle_corrections,
)
from services.controller.recorder import add_step, open_episode
from shared.db.models import Correction
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import Settings
from shared.storage import blob_store
from tests.services.corrector.conftest import FakeOpenAI, OneSlot, Reply, chat

AGENT = {"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}
YES = json.dumps({"answer1": "2, 4", "answer2": "yes", "evaluation": "YES", "correction": None})


def _steps(n: int) -> tuple[int, list[int]]:
    """A run and ``n`` steps, recorded by the controller's own writers."""
    with session_scope() as s:
        run = create_run(s, RunConfig(task="numberline"), "late-test")
        ep = open_episode(s, run.id, 0, 0, 0)
        ids = []
        for i in range(n):
            step = add_step(
                s,
                blob_store(),
                run_id=run.id,
                episode_id=ep.episode_id,
                idx=i,
                update_idx=0,
                rollout_pos=i,
                prompt="p",
                output=json.dumps(AGENT),
                format_valid=True,
                action_valid=True,
                reward=0.0,
                done=False,
                state={"current": 2, "target": 4},
            )
            s.flush()
            ids.append(step.id)
        return run.id, ids


def _pool(fake: FakeOpenAI, name: str, **params: object) -> ThreadCorrections:
    inline = {
        "name": name,
        "kind": "openai",
        "base_url": fake.url,
        "model": "m",
        "params": {"max_retries": 0, "structured": "none", **params},
    }
    return ThreadCorrections(name, 0.0, 0, Settings(), inline=inline)


def _outcomes(run_id: int) -> dict[int, tuple[str, str]]:
    with session_scope() as s:
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id)).all()
        return {r.step_id: (r.status, r.error or "") for r in rows}


def _until(check, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_a_late_malformed_answer_is_logged_as_what_was_stored(
    fake_openai: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake_openai.default = Reply(body=chat("not json at all").body, delay_s=1.5)
    run_id, ids = _steps(1)
    pool = _pool(fake_openai, "late-garbage")
    try:
        pool.submit(run_id, ids)
        _until(lambda: pool.in_flight(ids))
        assert settle_corrections(pool, run_id, ids, "late-garbage", timeout_s=0.2) == 1
    finally:
        pool.close()  # the late answer arrives now, after the step was recorded
    status, error = _outcomes(run_id)[ids[0]]
    assert (status, error) == ("failed", "timeout: no answer within 0.4 s")
    assert len(fake_openai.requests) == 1  # in flight: not sent again
    text = caplog.text
    assert "1 corrections missing after 0.2 s: 1 in flight" in text and "sent again" not in text
    assert "failed: malformed" not in text  # what the log says is what was stored
    assert (
        f"correction of step {ids[0]} by late-garbage: the answer (malformed: answer is not JSON"
        in text
    )
    assert "came after the step was recorded timeout: no answer within 0.4 s; dropped" in text


def test_the_end_of_a_run_drains_its_backlog_until_the_deadline_then_records_late(
    fake_openai: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    """wait = "none": a one-at-a-time server (0.3 s an answer), 6 steps queued at the end. The
    backlog drains for corrector.drain_s (1.1 s: ~3 answers); the rest are recorded ``late``,
    not failed, and never sent after that."""
    caplog.set_level(logging.INFO)
    fake_openai.serial = OneSlot()
    fake_openai.default = Reply(body=chat(YES).body, delay_s=0.3)
    run_id, ids = _steps(6)
    pool = _pool(fake_openai, "one-slot", concurrency=1, adaptive=False)
    try:
        pool.submit(run_id, ids)
        _until(lambda: pool.in_flight(ids))
        sweep = CorrectionSweep(pool, run_id, "one-slot", timeout_s=30.0)
        late = sweep.finish(drain_s=1.1)
    finally:
        pool.close()
    got = _outcomes(run_id)
    done = [i for i, (st, _) in got.items() if st == "done"]
    assert 2 <= len(done) <= 5 and late == 6 - len(done), got  # drained while time was left
    errors = [e for st, e in got.values() if st == "failed"]
    assert all(e.startswith("late: not in within corrector.drain_s = 1.1 s") for e in errors)
    # The late ones still queued were dropped when their slot came: at most one more was sent.
    assert len(fake_openai.requests) <= len(done) + 1
    assert "draining 6 corrections (up to corrector.drain_s = 1.1 s)" in caplog.text
