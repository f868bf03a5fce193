"""record_corrections: many steps in one transaction give the rows and counts that
record_correction gives one step at a time, on both stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from services.api.service import create_run
from services.controller.recorder import open_episode
from services.controller.writer import FrameShas, StepRecord, record_step_batch
from services.corrector.oracle import OracleCorrector
from services.corrector.service import record_correction, record_corrections
from services.env.expert import expert_output, format_output
from services.env.service import EnvPool
from shared.db.models import Correction, Episode
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.storage import blob_store

ENVS, STEPS = 4, 6
# A thought that misreads the frame (the oracle corrects it) or none at all (not well-formed).
WRONG = '{"current number": 9, "target number": 9, "thoughts": "9 = 9", "action": "+"}'


@pytest.fixture(params=["postgresql", "sqlite"])
def store_url(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return pg_url
    from shared.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'many.sqlite3'}"
    upgrade(url)
    return url


def _rollout(url: str) -> tuple[int, list[int]]:
    """A NumberLine run recorded by the controller's writer: expert, misread and junk outputs.
    Returns the run and its well-formed steps, in rollout order."""
    pool = EnvPool()
    sids = [pool.create("numberline", {"image_size": 32}, seed=e) for e in range(ENVS)]
    obs = [pool.reset(i) for i in sids]
    with session_scope(url) as s:
        run_id = create_run(s, RunConfig(task="numberline"), "many").id
        cursors = [open_episode(s, run_id, e, 0, 0) for e in range(ENVS)]
    frames, formed = FrameShas(blob_store()), []
    for t in range(STEPS):
        texts = [
            [format_output(expert_output("numberline", o.state)), WRONG, "junk"][(t + e) % 3]
            for e, o in enumerate(obs)
        ]
        results = pool.step_batch(list(zip(sids, texts, strict=True)))
        records = [
            StepRecord(e, o.image, _columns(t, e, o, r, text), r.done, r.success, r.final_state)
            for e, (o, r, text) in enumerate(zip(obs, results, texts, strict=True))
        ]
        with session_scope(url) as s:
            ids = record_step_batch(s, run_id, 0, records, cursors, frames)[0]
        formed += [i for i, r in zip(ids, results, strict=True) if r.parsed.format_valid]
        obs = [r.observation for r in results]
    return run_id, formed


def _columns(t: int, e: int, obs: Any, r: Any, text: str) -> dict[str, Any]:
    return {
        "update_idx": 0,
        "rollout_pos": t * ENVS + e,
        "prompt": obs.prompt,
        "output": text,
        "thought": r.parsed.thought,
        "action_text": r.parsed.action_text,
        "parsed_action": r.action,
        "format_valid": bool(r.parsed.format_valid),
        "action_valid": bool(r.parsed.action_valid),
        "reward": float(r.reward),
        "done": bool(r.done),
        "value": 0.0,
        "logprob": -1.0,
        "thought_entropy": None,
        "state": obs.state,
    }


def _outcome(url: str, run_id: int) -> tuple[list[tuple[Any, ...]], list[int]]:
    with session_scope(url) as s:
        rows = s.execute(
            select(
                Correction.status,
                Correction.verdict,
                Correction.corrected_thought,
                Correction.update_idx,
                Correction.attempts,
            )
            .where(Correction.run_id == run_id)
            .order_by(Correction.step_id)
        ).all()
        counts = s.scalars(
            select(Episode.corrected_steps).where(Episode.run_id == run_id).order_by(Episode.id)
        ).all()
    return [tuple(r) for r in rows], list(counts)


def test_a_batch_writes_what_one_at_a_time_writes(store_url: str) -> None:
    url, oracle = store_url, OracleCorrector()
    one_run, one_steps = _rollout(url)
    many_run, many_steps = _rollout(url)
    for sid in one_steps:
        with session_scope(url) as s:
            record_correction(s, sid, "oracle", oracle)
    # A pending row (as a re-queued step may have) is finished, not duplicated.
    with session_scope(url) as s:
        s.add(Correction(step_id=many_steps[0], run_id=many_run, update_idx=0, corrector="oracle"))
    half = len(many_steps) // 2
    with session_scope(url) as s:
        assert record_corrections(s, many_steps[:half], "oracle", oracle) == half
    with session_scope(url) as s:
        assert record_corrections(s, many_steps, "oracle", oracle) == len(many_steps) - half

    one, many = _outcome(url, one_run), _outcome(url, many_run)
    assert many == one  # same verdicts, thoughts and per-episode corrected counts
    rows, counts = many
    assert len(rows) == len(many_steps) and {r[0] for r in rows} == {"done"}
    assert {r[1] for r in rows} == {"correct", "incorrect"} and sum(counts) > 0
    with session_scope(url) as s:  # again: every step is settled, nothing is written twice
        assert record_corrections(s, many_steps, "oracle", oracle) == 0
        n = s.scalar(select(func.count()).where(Correction.run_id == many_run))
    assert n == len(many_steps) and _outcome(url, many_run) == many


def test_a_batch_that_loses_a_race_keeps_the_winners_rows(store_url: str) -> None:
    """Another writer finished a step between the batch's read and its insert: the winner's
    row stands and the rest of the batch is still written."""
    url, oracle = store_url, OracleCorrector()
    run_id, steps = _rollout(url)

    class Racing(OracleCorrector):
        def correct(self, req: Any, trace: Any = None) -> Any:
            with session_scope(url) as other:  # the other writer commits first
                if not other.scalar(select(Correction.id).where(Correction.step_id == steps[0])):
                    other.add(
                        Correction(
                            step_id=steps[0],
                            run_id=run_id,
                            update_idx=0,
                            corrector="oracle",
                            status="failed",
                            error="the winner",
                        )
                    )
            return oracle.correct(req, trace)

    with session_scope(url) as s:
        record_corrections(s, steps, "oracle", Racing())
    with session_scope(url) as s:
        rows = dict(
            s.execute(
                select(Correction.step_id, Correction.error).where(Correction.run_id == run_id)
            ).all()
        )
    assert rows.pop(steps[0]) == "the winner" and set(rows) == set(steps[1:])


def test_a_batch_corrector_answers_all_steps_in_one_call(store_url: str) -> None:
    """A corrector with ``correct_many`` (the self-teacher's protocol) is called once for the
    batch; its per-step failures and a failure of the whole call are recorded step by step."""
    from services.corrector.base import BatchCorrector, CorrectorError

    url, oracle = store_url, OracleCorrector()
    one_run, one_steps = _rollout(url)
    for sid in one_steps:
        with session_scope(url) as s:
            record_correction(s, sid, "oracle", oracle)

    class Batched(OracleCorrector):
        def __init__(self) -> None:
            self.calls: list[int] = []
            self.refuse: set[int] = set()  # indices of the batch answered with an error
            self.broken = False

        def correct_many(self, reqs: list[Any], traces: list[Any]) -> list[Any]:
            self.calls.append(len(reqs))
            if self.broken:
                raise RuntimeError("the teacher's process died")
            return [
                CorrectorError("malformed", "<b>not JSON</b>", "raw'\"<script>")
                if i in self.refuse
                else oracle.correct(r, t)
                for i, (r, t) in enumerate(zip(reqs, traces, strict=True))
            ]

    batched = Batched()
    assert isinstance(batched, BatchCorrector) and not isinstance(oracle, BatchCorrector)
    run_id, steps = _rollout(url)
    batched.refuse = {1}
    with session_scope(url) as s:
        assert record_corrections(s, steps, "oracle", batched) == len(steps)
    assert batched.calls == [len(steps)]
    rows, _ = _outcome(url, run_id)
    want, _ = _outcome(url, one_run)
    failed = [k for k, r in enumerate(rows) if r[0] == "failed"]
    assert len(failed) == 1  # the one refused; every other step as one at a time writes it
    k = failed[0]
    assert rows[:k] + rows[k + 1 :] == want[:k] + want[k + 1 :]
    with session_scope(url) as s:
        err, raw = s.execute(
            select(Correction.error, Correction.raw).where(
                Correction.run_id == run_id, Correction.status == "failed"
            )
        ).one()
    assert err is not None and "not JSON" in err and raw == "raw'\"<script>"

    broken_run, broken_steps = _rollout(url)
    batched.broken = True
    with session_scope(url) as s:
        record_corrections(s, broken_steps, "oracle", batched)
    rows, counts = _outcome(url, broken_run)
    assert len(rows) == len(broken_steps) and {r[0] for r in rows} == {"failed"} and not any(counts)
    with session_scope(url) as s:
        errors = set(s.scalars(select(Correction.error).where(Correction.run_id == broken_run)))
    assert errors == {"error: RuntimeError: the teacher's process died"}
