"""record_correction on real Postgres: one row per step and corrector, failures with reasons."""

from __future__ import annotations

import base64
import json
import threading

import pytest
from sqlalchemy import func, select

from services.corrector.base import CorrectorError
from services.corrector.remote import HttpCorrector, OpenAICorrector
from services.corrector.service import build_corrector, record_correction
from shared.db import models
from shared.db.session import session_scope
from shared.settings import get_settings
from shared.storage import blob_store
from tests.services.corrector.conftest import FakeOpenAI, chat
from tests.services.corrector.helpers import make_run, make_step

AGENT = {"current number": 1, "target number": 3, "thoughts": "1 < 3 so I add 1", "action": "+"}
STATE = {"current": 1, "target": 3}
YES = json.dumps({"answer1": "1 and 3", "answer2": "yes", "evaluation": "YES", "correction": None})


def _corrector(fake: FakeOpenAI) -> OpenAICorrector:
    params = {"max_retries": 1, "backoff_base_s": 0.01, "vision": True}
    return OpenAICorrector(fake.url, "m", None, params)


def _count(session, step_id: int) -> int:  # type: ignore[no-untyped-def]
    return session.scalar(select(func.count()).where(models.Correction.step_id == step_id)) or 0


def test_done_once_with_image_history_and_costs(db, fake_openai: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    image = b"\x89PNG fake image bytes"
    sha = blob_store().put(image)
    first = make_step(db, "numberline", STATE, AGENT)
    first.parsed_action = "-"
    episode = db.get(models.Episode, first.episode_id)
    step = make_step(
        db,
        "numberline",
        STATE,
        AGENT,
        run=db.get(models.Run, first.run_id),
        image_sha=sha,
        idx=1,
        episode=episode,
    )
    fake_openai.then(chat(YES, tokens=55))
    row = record_correction(db, step.id, "fake", _corrector(fake_openai))
    assert (row.status, row.verdict, row.tokens, row.attempts) == ("done", "correct", 55, 1)
    assert row.raw == YES and row.latency_ms and row.latency_ms > 0 and row.finished_at
    sent = fake_openai.requests[0]["json"]["messages"][1]["content"]
    assert sent[1]["image_url"]["url"].endswith(base64.b64encode(image).decode())
    again = record_correction(db, step.id, "fake", _corrector(fake_openai))
    assert again.id == row.id and len(fake_openai.requests) == 1 and _count(db, step.id) == 1


def test_malformed_is_a_recorded_failure_never_a_target(db, fake_openai: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    step = make_step(db, "numberline", STATE, AGENT)
    fake_openai.then(chat("Sure! The thought looks fine to me."))
    row = record_correction(db, step.id, "fake", _corrector(fake_openai))
    assert row.status == "failed" and row.error.startswith("malformed: answer is not JSON")
    assert row.corrected_thought is None and row.verdict is None
    assert row.raw == "Sure! The thought looks fine to me." and row.tokens == 30
    assert record_correction(db, step.id, "fake", _corrector(fake_openai)).id == row.id
    assert len(fake_openai.requests) == 1


def test_run_budget_spent_is_recorded_without_a_call(db, fake_openai: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    run = make_run(db, corrector={"max_calls": 1})
    fake_openai.default = chat(YES)
    a = make_step(db, "numberline", STATE, AGENT, run=run)
    b = make_step(db, "numberline", STATE, AGENT, run=run, idx=1)
    assert record_correction(db, a.id, "fake", _corrector(fake_openai)).status == "done"
    row = record_correction(db, b.id, "fake", _corrector(fake_openai))
    assert row.status == "failed" and row.error == "budget: call budget of 1 spent"
    assert len(fake_openai.requests) == 1


class _Broken:
    def correct(self, req, trace=None):  # type: ignore[no-untyped-def]
        raise KeyError("possible_solution")


class _NoState:
    def correct(self, req, trace=None):  # type: ignore[no-untyped-def]
        raise CorrectorError("input", f"state given: {req.state is not None}")


@pytest.mark.parametrize(
    "corrector, error",
    [
        (_Broken(), "error: KeyError: 'possible_solution'"),
        (_NoState(), "input: state given: True"),
    ],
)
def test_any_failure_is_recorded_with_its_reason(db, corrector, error: str) -> None:  # type: ignore[no-untyped-def]
    step = make_step(db, "numberline", STATE, AGENT)
    row = record_correction(db, step.id, "x", corrector)
    assert row.status == "failed" and row.error == error


def test_unknown_step_is_a_lookup_error(db) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LookupError):
        record_correction(db, 10**12, "x", _Broken())


def test_racing_writers_make_one_row(pg_url: str, fake_openai: FakeOpenAI) -> None:
    with session_scope() as s:
        step_id = make_step(s, "numberline", STATE, AGENT).id
    fake_openai.default = chat(YES)
    fake_openai.default.delay_s = 0.3  # the writers overlap: each may call, one row is kept
    ids: list[int] = []

    def write() -> None:
        with session_scope() as s:
            ids.append(record_correction(s, step_id, "fake", _corrector(fake_openai)).id)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with session_scope() as s:
        assert _count(s, step_id) == 1
    assert len(ids) == 2 and ids[0] == ids[1]
    # Redelivered later, the task finds the row and calls nothing.
    with session_scope() as s:
        assert record_correction(s, step_id, "fake", _corrector(fake_openai)).id == ids[0]
    assert 1 <= len(fake_openai.requests) <= 2


def test_a_pending_row_is_finished(db, fake_openai: FakeOpenAI) -> None:  # type: ignore[no-untyped-def]
    step = make_step(db, "numberline", STATE, AGENT)
    pending = models.Correction(step_id=step.id, run_id=step.run_id, update_idx=0, corrector="fake")
    db.add(pending)
    db.flush()
    fake_openai.then(chat(YES))
    row = record_correction(db, step.id, "fake", _corrector(fake_openai))
    assert row.id == pending.id and row.status == "done" and _count(db, step.id) == 1


def test_embedded_oracle_on_a_rendered_step(db) -> None:  # type: ignore[no-untyped-def]
    from tests.services.corrector.helpers import env_ready

    env_ready()
    from services.corrector.registry import sample_request

    corrector = build_corrector("oracle", db, get_settings())
    # Deal 6 has a solution (6 7 7 5), deal 5 none (9 10 1 10): a misread of the first is
    # corrected from the rendered step's state; the second has nothing to teach (GTR's rule).
    for seed, solvable in [(6, True), (5, False)]:
        req = sample_request("points24", seed=seed)
        assert req.state is not None and req.state["solvable"] is solvable
        sha = blob_store().put(base64.b64decode(req.image_png_b64 or ""))
        wrong = {**json.loads(req.output), "cards": [1, 1, 1, 1]}
        step = make_step(db, "points24", req.state, wrong, image_sha=sha, prompt=req.prompt)
        row = record_correction(db, step.id, "oracle", corrector)
        assert row.status == "done" and row.verdict == "incorrect"
        assert row.extras["possible_solution"] is solvable
        if solvable:
            thought = json.loads(row.corrected_thought or "")
            assert sorted(thought["cards"]) == sorted(req.state["numbers"])
        else:
            assert row.corrected_thought is None


def test_build_corrector_from_the_registry(db, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    settings = get_settings()
    db.add(
        models.Corrector(
            name="by-env",
            kind="openai",
            base_url="http://127.0.0.1:9/v1",
            model="m",
            params={"timeout_s": 3},
            api_key_env="GTR_CORRECTOR_KEY_TEST_X",
        )
    )
    db.add(models.Corrector(name="by-http", kind="http", base_url="http://127.0.0.1:9", params={}))
    db.flush()
    with pytest.raises(CorrectorError, match="GTR_CORRECTOR_KEY_TEST_X is not set"):
        build_corrector("by-env", db, settings)
    monkeypatch.setenv("GTR_CORRECTOR_KEY_TEST_X", "sk-from-env")
    built = build_corrector("by-env", db, settings)
    assert isinstance(built, OpenAICorrector) and built.client.api_key == "sk-from-env"
    assert built.params.timeout_s == 3
    assert isinstance(build_corrector("by-http", db, settings), HttpCorrector)
    assert build_corrector("oracle", db, settings, noise=0.25).noise == 0.25  # type: ignore[attr-defined]
    with pytest.raises(CorrectorError, match="no corrector named 'nobody'"):
        build_corrector("nobody", db, settings)
