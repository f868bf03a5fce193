"""A hostile OpenAI-compatible endpoint behind `record_correction`, on real PostgreSQL.

The endpoint is a real local HTTP server (the only stand-in allowed: OpenAI itself). It hangs,
answers garbage, valid JSON of the wrong shape, a huge body, or 429 for a long time. Each step's
failure is recorded once with its reason, never reaches the DAgger buffer, the circuit opens and
closes again, and the calls counted at the server never exceed the run's budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import select

from services.corrector.remote import OpenAICorrector
from services.corrector.service import record_correction
from services.trainer.buffer import DaggerBuffer
from shared.db import models
from shared.db.session import session_scope
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat
from tests.services.corrector.conftest import fake_openai as fake_openai  # noqa: F401 - fixture
from tests.services.corrector.helpers import make_run, make_step

AGENT = {"current number": 1, "target number": 3, "thoughts": "1 > 3 so I subtract", "action": "-"}
STATE = {"current": 1, "target": 3}
FIXED = {"current number": 1, "target number": 3, "thoughts": "1 < 3 so I add 1"}
NO = json.dumps({"answer1": "1 and 3", "evaluation": "NO", "correction": FIXED})
FAST = {"max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02, "timeout_s": 0.5}


def _corrector(fake: FakeOpenAI, **params: Any) -> OpenAICorrector:
    return OpenAICorrector(fake.url, "gpt-test", "sk-test", {**FAST, **params})


def _steps(db, n: int, corrector: dict[str, Any] | None = None) -> list[int]:  # type: ignore[no-untyped-def]
    run = make_run(db, corrector=corrector)
    episode = models.Episode(run_id=run.id, env_index=0, seq=run.id, update_idx=0)
    db.add(episode)
    db.flush()
    return [
        make_step(db, "numberline", STATE, AGENT, run, idx=i, episode=episode).id for i in range(n)
    ]


def _buffer_ids(db, run_id: int) -> set[int]:  # type: ignore[no-untyped-def]
    buffer = DaggerBuffer(run_id)
    buffer.refresh(db)
    return {e.correction_id for e in buffer.examples}


@pytest.fixture
def fake(fake_openai: FakeOpenAI, pg_url: str) -> Iterator[FakeOpenAI]:  # noqa: F811
    yield fake_openai


HOSTILE = {
    "hangs": (Reply(body={}, delay_s=5.0), "transport: gave up after 2 attempts: timeout"),
    "garbage": (Reply(body="\x00\xff<html>502 Bad Gateway</html>\x1b[0m"), "malformed: unreadable"),
    "wrong_schema": (
        Reply(body={"result": {"text": "looks fine"}}),
        "malformed: not a chat completion",
    ),
    "answer_wrong_schema": (
        chat(json.dumps({"verdict": "ok", "fix": []})),
        "malformed: evaluation",
    ),
    "status_418": (Reply(418, {"error": {"message": "teapot"}}), "transport: HTTP 418"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_is_a_recorded_failure_never_a_target(
    db, fake: FakeOpenAI, name: str
) -> None:  # type: ignore[no-untyped-def]
    reply, reason = HOSTILE[name]
    fake.default = reply
    bad, good = _steps(db, 2)
    row = record_correction(db, bad, "fake", _corrector(fake))
    assert row.status == "failed" and row.error.startswith(reason), row.error
    assert row.verdict is None and row.corrected_thought is None and row.finished_at is not None
    calls = len(fake.requests)
    assert row.attempts == calls and calls >= 1
    # Asked again (a redelivered task): the recorded failure is returned, nothing is called.
    assert record_correction(db, bad, "fake", _corrector(fake)).id == row.id
    assert len(fake.requests) == calls
    fake.default = chat(NO)
    ok = record_correction(db, good, "fake", _corrector(fake))
    assert ok.status == "done" and ok.verdict == "incorrect"
    assert _buffer_ids(db, ok.run_id) == {ok.id}  # the good one trains, the failure never


def test_a_huge_body_is_refused_and_not_stored_whole(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    fake.default = chat("{" + '"x": "' + "A" * 8_000_000 + '"}')
    (step,) = _steps(db, 1)
    row = record_correction(db, step, "fake", _corrector(fake))
    assert row.status == "failed" and row.error.startswith("malformed: evaluation")
    assert _buffer_ids(db, row.run_id) == set()


def test_the_raw_answer_kept_for_audit_is_bounded(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    fake.default = chat("{" + '"x": "' + "A" * 8_000_000 + '"}')
    (step,) = _steps(db, 1)
    row = record_correction(db, step, "fake", _corrector(fake))
    assert len(row.raw or "") <= 100_000


def test_429_for_minutes_opens_the_circuit_then_it_closes(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    # The server asks for 10 minutes; the corrector caps its wait (retry_after_max_s) and gives up.
    fake.default = Reply(429, {"error": {"message": "rate limited"}}, {"Retry-After": "600"})
    corrector = _corrector(
        fake, retry_after_max_s=0.05, breaker_threshold=3, breaker_cooldown_s=1.0
    )
    steps = _steps(db, 8)
    rows = [record_correction(db, s, "fake", corrector) for s in steps[:5]]
    assert [r.error.split(":")[0] for r in rows] == ["transport"] * 3 + ["circuit_open"] * 2
    assert all("HTTP 429" in r.error for r in rows[:3])
    assert len(fake.requests) == 3 * 2  # open: no call reaches the endpoint
    assert corrector.breaker.state == "open"
    import time

    time.sleep(1.1)  # the cooldown passes; the endpoint has recovered
    fake.default = chat(NO)
    rows += [record_correction(db, s, "fake", corrector) for s in steps[5:]]
    assert [r.status for r in rows[5:]] == ["done"] * 3 and corrector.breaker.state == "closed"
    assert _buffer_ids(db, rows[0].run_id) == {r.id for r in rows[5:]}
    assert all(r.attempts for r in rows[:3]) and all(r.attempts == 0 for r in rows[3:5])


def test_the_call_budget_holds_one_call_at_a_time(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    fake.default = chat(NO)
    steps = _steps(db, 7, corrector={"max_calls": 4})
    rows = [record_correction(db, s, "fake", _corrector(fake)) for s in steps]
    assert len(fake.requests) == 4
    assert [r.status for r in rows] == ["done"] * 4 + ["failed"] * 3
    assert all(r.error == "budget: call budget of 4 spent" and r.attempts == 0 for r in rows[4:])


def test_the_token_budget_stops_further_calls(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    fake.default = chat(NO, tokens=40)
    steps = _steps(db, 5, corrector={"max_tokens": 100})
    rows = [record_correction(db, s, "fake", _corrector(fake)) for s in steps]
    assert len(fake.requests) == 3  # 40 + 40 < 100 allows a third call, then it is spent
    assert [r.status for r in rows] == ["done"] * 3 + ["failed"] * 2


def test_the_call_budget_holds_while_retrying(db, fake: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    fake.default = Reply(503, {"error": {"message": "overloaded"}})
    steps = _steps(db, 4, corrector={"max_calls": 4})
    rows = [
        record_correction(db, s, "fake", _corrector(fake, max_retries=2, breaker_threshold=100))
        for s in steps
    ]
    # Each retry reserves its call: 3 attempts for the first step, 1 for the second, then none.
    assert len(fake.requests) == 4 and [r.attempts for r in rows] == [3, 1, 0, 0]
    assert rows[0].error.startswith("transport: gave up after 3 attempts")
    assert all(r.error == "budget: call budget of 4 spent" for r in rows[1:])


def test_the_call_budget_holds_under_concurrency(pg_url: str, fake: FakeOpenAI) -> None:
    slow = chat(NO)
    slow.delay_s = 1.0
    fake.default = slow
    with session_scope() as s:
        steps = _steps(s, 8, corrector={"max_calls": 3})
    corrector = _corrector(fake, concurrency=8, timeout_s=5.0)  # answers take 1 s

    def one(step_id: int) -> str:
        with session_scope() as s:
            return record_correction(s, step_id, "fake", corrector).status

    with ThreadPoolExecutor(4) as pool:  # the embedded pool and Celery prefork both do this
        statuses = list(pool.map(one, steps))
    with session_scope() as s:
        rows = s.scalars(
            select(models.Correction).where(models.Correction.step_id.in_(steps))
        ).all()
        assert len(rows) == 8 and statuses.count("done") == len(fake.requests)
        assert sum(r.attempts for r in rows) == 3
    assert len(fake.requests) == 3  # never more, and the budget is used in full
