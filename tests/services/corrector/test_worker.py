"""The `corrector` Celery worker on real Redis and Postgres: redelivery writes nothing twice."""

from __future__ import annotations

import json

from sqlalchemy import select

from shared.db import models
from shared.db.session import session_scope
from shared.queues import TASK_CORRECT, TASK_CORRECT_BATCH, celery_app
from tests.conftest import celery_worker
from tests.services.corrector.conftest import FakeOpenAI, chat
from tests.services.corrector.helpers import make_step

AGENT = {"current number": 4, "target number": 1, "thoughts": "4 > 1 so I subtract", "action": "-"}
YES = json.dumps({"answer1": "4 and 1", "answer2": "yes", "evaluation": "YES", "correction": None})


def test_redelivered_tasks_write_once(pg_url: str, redis_url: str, fake_openai: FakeOpenAI) -> None:
    fake_openai.default = chat(YES, tokens=21)
    with session_scope() as s:
        s.add(
            models.Corrector(
                name="worker-fake",
                kind="openai",
                base_url=fake_openai.url,
                model="m",
                params={"max_retries": 0},
            )
        )
        step_id = make_step(s, "numberline", {"current": 4, "target": 1}, AGENT).id
        other_id = make_step(s, "numberline", {"current": 4, "target": 1}, AGENT).id
        first = make_step(s, "numberline", {"current": 4, "target": 1}, AGENT)
        run = s.get(models.Run, first.run_id)
        wrong = AGENT | {"current number": 3}  # the oracle corrects this one
        batch = [
            first.id,
            make_step(s, "numberline", {"current": 4, "target": 1}, wrong, run=run, idx=1).id,
        ]
    with celery_worker("corrector"):
        # The same task three times: what a redelivery after a lost ack looks like to the worker.
        sent = [celery_app.send_task(TASK_CORRECT, args=[step_id, "worker-fake"]) for _ in range(3)]
        missing = celery_app.send_task(TASK_CORRECT, args=[other_id, "nobody"])
        batches = [
            celery_app.send_task(TASK_CORRECT_BATCH, args=[batch, "oracle"]) for _ in range(2)
        ]
        results = [r.get(timeout=60) for r in sent]
        failure = missing.get(timeout=60)
        assert sorted(r.get(timeout=60)["corrected"] for r in batches) == [0, 2]
    assert len({r["correction_id"] for r in results}) == 1 and {r["status"] for r in results} == {
        "done"
    }
    assert len(fake_openai.requests) == 1
    assert failure["status"] == "failed"
    with session_scope() as s:
        rows = s.scalars(
            select(models.Correction).where(models.Correction.step_id == step_id)
        ).all()
        assert [(r.status, r.verdict, r.tokens) for r in rows] == [("done", "correct", 21)]
        bad = s.scalar(select(models.Correction).where(models.Correction.step_id == other_id))
        assert bad is not None and bad.error
        assert bad.error.startswith("config: no corrector named 'nobody' is registered")
        oracle = s.execute(
            select(models.Correction.status, models.Correction.verdict)
            .where(models.Correction.step_id.in_(batch))
            .order_by(models.Correction.step_id)
        ).all()
        assert [tuple(r) for r in oracle] == [("done", "correct"), ("done", "incorrect")]
