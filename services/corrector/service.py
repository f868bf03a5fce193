"""Corrector service: build a corrector by name, and record one correction per step.

`record_correction` is what both the embedded thread pool and the Celery task call: it loads the
step, calls the corrector, and writes the result (or the failure and its reason) exactly once per
step and corrector. `record_corrections` does the same for many steps with one read and one write
for all of them, for correctors that answer in process (the oracle), where the per-step
transaction cost far more than the correction itself.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.corrector.base import BatchCorrector, CallTrace, Corrector, CorrectorError
from services.corrector.egress import stored_error
from services.corrector.keys import decrypt_key, key_not_teams
from services.corrector.oracle import OracleCorrector, accurate
from services.corrector.remote import HttpCorrector, OpenAICorrector, RemoteParams
from services.corrector.resilience import Budget, BudgetExceeded
from services.corrector.rows import RegistryError, inline_row
from services.corrector.spend import RunBudget, run_budget
from shared.db import models
from shared.db.bulk import insert_many, insert_new
from shared.db.models import utcnow
from shared.schemas import SELF_TEACHER, Correction, CorrectionRequest
from shared.settings import Settings
from shared.storage import BlobStore, blob_store

__all__ = [
    "BudgetExceeded",
    "Corrector",
    "CorrectorError",
    "HttpCorrector",
    "OpenAICorrector",
    "OracleCorrector",
    "build_corrector",
    "record_correction",
    "record_corrections",
    "request_for_step",
]

log = logging.getLogger("gtr.corrector")
ORACLE = "oracle"


def build_corrector(
    name: str,
    session: Session,
    settings: Settings,
    noise: float = 0.0,
    seed: int = 0,
    budget: Budget | None = None,
    team: str | None = None,
    run_id: int | None = None,
    inline: dict[str, Any] | None = None,
    errors: dict[str, Any] | None = None,
) -> Corrector:
    """'oracle' (fallible with the run's ``corrector.errors``) or 'self_teacher' (built in; the
    latter serves run ``run_id``), the run config's
    `inline` one, or a registered corrector by name; with `team` (the run's), only one of that
    team's or a shared one: another team's key never serves this team's steps."""
    if inline is not None:
        try:
            made = inline_row(inline, settings)
        except RegistryError as e:
            raise CorrectorError("config", f"the run's inline corrector: {e}") from e
        refused = key_not_teams(session, team, inline) if team is not None else None
        if refused is not None:  # checked at launch too; a stored run may predate that check
            raise CorrectorError("config", f"the run's inline corrector: {refused}")
        return corrector_from_row(made, settings, noise=noise, seed=seed, budget=budget)
    if name == ORACLE:
        return _oracle(noise, seed, errors)
    if name == SELF_TEACHER:
        return _self_teacher(session, run_id)
    row = session.scalar(select(models.Corrector).where(models.Corrector.name == name))
    if row is None:
        raise CorrectorError(
            "config",
            f"no corrector named '{name}' is registered (gtr corrector add, or define it inline "
            "in the run's [corrector] with kind and base_url)",
        )
    if team is not None and not usable_by(row, team):
        raise CorrectorError("config", f"corrector '{name}' is not available to team '{team}'")
    return corrector_from_row(row, settings, noise=noise, seed=seed, budget=budget)


def _oracle(noise: float, seed: int, errors: dict[str, Any] | None) -> Corrector:
    """The exact oracle, the noisy one, or the fallible one (GPT-4o-like errors per kind)."""
    from services.corrector.fallible import FallibleCorrector
    from shared.schemas import CorrectorErrors

    made = CorrectorErrors.model_validate(errors or {})
    return FallibleCorrector(made, seed) if made.any() else OracleCorrector(noise=noise, seed=seed)


def usable_by(row: models.Corrector, team: str) -> bool:
    """A run may use its own team's correctors and those an admin marked shared."""
    return row.team == team or bool(row.shared)


def _self_teacher(session: Session, run_id: int | None) -> Corrector:
    from services.corrector.self_teacher import SelfTeacherCorrector
    from shared.schemas import RunConfig

    run = session.get(models.Run, run_id) if run_id is not None else None
    if run is None:
        raise CorrectorError("config", "the self_teacher corrector serves one run: none given")
    return SelfTeacherCorrector(run.id, RunConfig.model_validate(run.config))


def corrector_from_row(
    row: models.Corrector,
    settings: Settings,
    noise: float = 0.0,
    seed: int = 0,
    budget: Budget | None = None,
    overrides: dict[str, Any] | None = None,
) -> Corrector:
    """The corrector a registry row describes; `overrides` replace some of its params."""
    if row.kind == "oracle":
        own = row.params or {}
        return _oracle(float(own.get("noise", noise)), seed, own.get("errors"))
    params = RemoteParams(**{**(row.params or {}), **(overrides or {})})
    key = decrypt_key(row, settings)
    if row.kind == "openai":
        return OpenAICorrector(row.base_url or "", row.model or "", key, params, budget)
    if row.kind == "http":
        return HttpCorrector(row.base_url or "", key, params, budget)
    raise CorrectorError("config", f"corrector '{row.name}' has unknown kind '{row.kind}'")


def request_for_step(session: Session, step: models.Step, blobs: BlobStore) -> CorrectionRequest:
    """The correction request of a recorded step: its image, prompt, output, state and history."""
    image = base64.b64encode(blobs.get(step.image_sha)).decode() if step.image_sha else None
    history = session.scalars(
        select(models.Step.parsed_action)
        .where(models.Step.episode_id == step.episode_id, models.Step.idx < step.idx)
        .order_by(models.Step.idx)
    ).all()
    run = session.get(models.Run, step.run_id)
    if run is None:
        raise LookupError(f"run {step.run_id} of step {step.id} not found")
    return CorrectionRequest.model_validate(
        {
            "task": run.task,
            "image_png_b64": image,
            "prompt": step.prompt,
            "output": step.output,
            "state": step.state or None,
            "history": [h or "" for h in history][-200:],
        }
    )


def _existing(session: Session, step_id: int, name: str) -> models.Correction | None:
    return session.scalar(
        select(models.Correction).where(
            models.Correction.step_id == step_id, models.Correction.corrector == name
        )
    )


def record_correction(
    session: Session,
    step_id: int,
    corrector_name: str,
    corrector: Corrector,
    blobs: BlobStore | None = None,
    on_send: Callable[[], None] | None = None,
) -> models.Correction:
    """Corrects one step once: an existing done/failed row is returned and nothing is called.

    The call happens before any write, so no transaction (nor SQLite's single writer lock) is
    held while a slow corrector thinks; a writer that lost a race returns the winner's row.
    """
    step = session.get(models.Step, step_id)
    if step is None:
        raise LookupError(f"step {step_id} not found")
    row = _existing(session, step_id, corrector_name)
    if row is not None and row.status in ("done", "failed"):
        return row
    values = _outcome(session, step, corrector_name, corrector, blobs or blob_store(), on_send)
    if row is None:
        try:
            with session.begin_nested():
                row = models.Correction(
                    step_id=step.id,
                    run_id=step.run_id,
                    update_idx=step.update_idx,
                    corrector=corrector_name,
                )
                for key, value in values.items():
                    setattr(row, key, value)
                session.add(row)
            count_corrected(session, step, values)
            _log_outcome(step.id, corrector_name, values)
            return row
        except IntegrityError:
            row = _existing(session, step_id, corrector_name)
            assert row is not None
    # A pending row (queued by the controller) is finished only if nobody finished it meanwhile.
    finished = session.execute(
        update(models.Correction)
        .where(models.Correction.id == row.id, models.Correction.status == "pending")
        .values(**values)
    )
    if finished.rowcount == 1:  # type: ignore[attr-defined]
        count_corrected(session, step, values)
        _log_outcome(step.id, corrector_name, values)
    session.refresh(row)
    if finished.rowcount != 1:  # type: ignore[attr-defined]
        _log_outcome(step.id, corrector_name, values, stored=row)
    return row


def _log_outcome(
    step_id: int, name: str, values: dict[str, Any], stored: models.Correction | None = None
) -> None:
    """The log says what the row says: a failure as it was written, or, for an answer that
    came after the step was settled (a timeout recorded it), that it was dropped."""
    if str(values.get("error") or "").startswith("skipped:"):
        return  # never sent: the stored row says why
    if stored is not None:
        got = values.get("error") or f"verdict {values.get('verdict')}"
        log.warning(
            "correction of step %s by %s: the answer (%s) came after the step was recorded "
            "%s; dropped",
            step_id,
            name,
            got,
            stored.error or stored.status,
        )
    elif values.get("status") == "failed":
        log.warning("correction of step %s by %s failed: %s", step_id, name, values["error"])


def count_corrected(session: Session, step: models.Step, values: dict[str, Any]) -> None:
    """A step the corrector disagreed with counts once in its episode's ``corrected_steps``.

    Called only by the writer that moved the correction out of 'pending' (exactly once per
    step and corrector), so an atomic increment is right under concurrent workers and also for
    a correction that arrives after its update was trained or its episode closed."""
    if values.get("status") == "done" and values.get("verdict") == "incorrect":
        session.execute(
            update(models.Episode)
            .where(models.Episode.id == step.episode_id)
            .values(corrected_steps=models.Episode.corrected_steps + 1)
        )


def _outcome(
    session: Session,
    step: models.Step,
    name: str,
    corrector: Corrector,
    blobs: BlobStore,
    on_send: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The columns of the step's correction: the result, or the failure and its reason."""

    def wanted() -> bool:
        """Once the endpoint has a slot: still unsettled? (`on_send`: it leaves the backlog,
        or raises a CorrectorError if the run withdrew it from the backlog meanwhile)"""
        row = _existing(session, step.id, name)
        session.commit()  # nothing written yet: the connection goes back while the call runs
        if row is not None and row.status != "pending":
            return False
        if on_send is not None:
            on_send()
        return True

    def request() -> CorrectionRequest:
        req = request_for_step(session, step, blobs)
        # Hundreds of corrections wait on a slow endpoint at once: none holds a database
        # connection meanwhile (the pool has a few dozen).
        session.commit()
        return req

    budget = run_budget(session, step.run_id, name)
    # The budget checks on a connection of its own: this session holds none meanwhile, or a
    # burst of threads, each holding one and waiting for a second, would drain the pool.
    session.commit()
    return _answer(step, name, corrector, request, budget, wanted)


def _answer(
    step: models.Step,
    name: str,
    corrector: Corrector,
    request: Callable[[], CorrectionRequest],
    budget: RunBudget | None,
    wanted: Callable[[], bool] | None,
) -> dict[str, Any]:
    trace = CallTrace(budget=budget, wanted=wanted)
    start = time.perf_counter()
    try:
        if budget is not None:
            budget.check()  # spent already: no request is even built
        req = request()
        correction = corrector.correct(req, trace)
    except Exception as e:  # noqa: BLE001 - a corrector bug becomes a recorded failure, not a crash
        return _error(step, name, trace, start, e)
    return _done(correction, trace, req)


def _answer_many(
    steps: list[models.Step],
    name: str,
    corrector: BatchCorrector,
    requests: dict[int, Callable[[], CorrectionRequest]],
    budgets: dict[int, RunBudget | None],
) -> list[dict[str, Any]]:
    """``_answer`` for many steps in one ``correct_many`` call; a step whose request cannot be
    built, or whose run's budget is spent, fails alone and is not sent."""
    start = time.perf_counter()
    traces = [CallTrace(budget=budgets[st.run_id]) for st in steps]
    out: dict[int, dict[str, Any]] = {}
    sent: list[tuple[int, CorrectionRequest]] = []
    for i, (st, trace) in enumerate(zip(steps, traces, strict=True)):
        try:
            budget = budgets[st.run_id]
            if budget is not None:
                budget.check()  # spent already: no request is even built
            sent.append((i, requests[st.id]()))
        except Exception as e:  # noqa: BLE001 - recorded on that step
            out[i] = _error(st, name, trace, start, e)
    if sent:
        try:
            results: list[Any] = corrector.correct_many(
                [req for _, req in sent], [traces[i] for i, _ in sent]
            )
            if len(results) != len(sent):
                raise RuntimeError(f"{len(results)} answers to {len(sent)} requests")
        except Exception as e:  # noqa: BLE001 - the whole call failed: every step records why
            results = [e] * len(sent)
        for (i, req), result in zip(sent, results, strict=True):
            out[i] = (
                _error(steps[i], name, traces[i], start, result)
                if isinstance(result, Exception)
                else _done(result, traces[i], req)
            )
    return [out[i] for i in range(len(steps))]


def _with_accuracy(correction: Correction, req: CorrectionRequest | None) -> dict[str, Any]:
    """The answer's extras plus ``accurate``: whether it agrees with the exact judge (verdict and
    correction, ``oracle.accurate``), which the run's ``corrector/accuracy`` averages."""
    if req is None or req.state is None:
        return correction.extras
    try:
        verdict = accurate(req, correction)
    except Exception:  # noqa: BLE001 - a state the judge cannot read costs the figure, not the answer
        log.exception("exact judge failed on a %s state", req.task)
        return correction.extras
    return correction.extras if verdict is None else {**correction.extras, "accurate": verdict}


def _error(
    step: models.Step, name: str, trace: CallTrace, start: float, e: Exception
) -> dict[str, Any]:
    if isinstance(e, CorrectorError):
        return _failure(step, name, trace, start, stored_error(e), e.raw)
    log.error("corrector %s crashed on step %s", name, step.id, exc_info=e)
    return _failure(step, name, trace, start, f"error: {type(e).__name__}: {str(e)[:500]}")


def _done(
    correction: Correction, trace: CallTrace, req: CorrectionRequest | None = None
) -> dict[str, Any]:
    return {
        "status": "done",
        "verdict": correction.verdict,
        "corrected_thought": correction.corrected_thought,
        "extras": _with_accuracy(correction, req),
        "reasoning": correction.reasoning,
        "raw": trace.raw,
        "latency_ms": correction.latency_ms,
        "tokens": correction.tokens,
        "attempts": max(trace.attempts, 1),
        "finished_at": utcnow(),
    }


def _failure(
    step: models.Step, name: str, trace: CallTrace, start: float, error: str, raw: str | None = None
) -> dict[str, Any]:
    return {
        "status": "failed",
        "error": error,
        "raw": (raw or trace.raw or "")[:20_000] or None,
        "tokens": trace.tokens,
        "attempts": trace.attempts,
        "latency_ms": (time.perf_counter() - start) * 1000,
        "finished_at": utcnow(),
    }


# ---- many steps at once ---------------------------------------------------------------------

# Correctors that answer in process: a rollout step's steps are corrected in one batch (the
# oracle in microseconds, the self-teacher in one batched decode: ``BatchCorrector``).
BATCHED = frozenset({ORACLE, SELF_TEACHER})

_ROW: dict[
    str, Any
] = {  # every column a correction row sets, so that all rows of a batch share their keys
    "verdict": None,
    "corrected_thought": None,
    "extras": {},
    "reasoning": None,
    "raw": None,
    "error": None,
    "latency_ms": None,
    "tokens": 0,
    "attempts": 0,
    "finished_at": None,
}


def record_corrections(
    session: Session,
    step_ids: list[int],
    corrector_name: str,
    corrector: Corrector,
    blobs: BlobStore | None = None,
) -> int:
    """``record_correction`` for many steps: the same rows and counts, with one read of the
    steps (their runs and correction states joined), one of their episodes' histories, and one
    insert for all the new rows. The corrector is called one step after another: meant for
    correctors that answer in process. Steps with a pending row go through
    ``record_correction``; a step another writer finished meanwhile keeps that writer's row.
    Returns the steps corrected by this call."""
    blobs = blobs or blob_store()
    found = session.execute(
        select(models.Step, models.Run.task, models.Correction.status)
        .join(models.Run, models.Run.id == models.Step.run_id)
        .outerjoin(
            models.Correction,
            (models.Correction.step_id == models.Step.id)
            & (models.Correction.corrector == corrector_name),
        )
        .where(models.Step.id.in_(step_ids))
    ).all()
    fresh = [st for st, _, state in found if state is None]
    tasks = {st.run_id: task for st, task, _ in found}
    requests = _requests(session, fresh, tasks, blobs)
    budgets = {r: run_budget(session, r, corrector_name) for r in {st.run_id for st in fresh}}
    if isinstance(corrector, BatchCorrector):
        answers = _answer_many(fresh, corrector_name, corrector, requests, budgets)
    else:
        answers = [
            _answer(st, corrector_name, corrector, requests[st.id], budgets[st.run_id], None)
            for st in fresh
        ]
    rows = []
    for st, values in zip(fresh, answers, strict=True):
        base = {"step_id": st.id, "run_id": st.run_id, "update_idx": st.update_idx}
        rows.append(_ROW | base | {"corrector": corrector_name} | values)
    written = _insert_new(session, rows, corrector, blobs) if rows else set()
    for r in rows:
        if r["step_id"] in written:
            _log_outcome(r["step_id"], corrector_name, r)
    _count_corrected_many(session, {st.id: st for st in fresh}, rows, written)
    pending = [st.id for st, _, state in found if state == "pending"]
    for sid in pending:
        record_correction(session, sid, corrector_name, corrector, blobs)
    return len(written) + len(pending)


def _insert_new(
    session: Session, rows: list[dict[str, Any]], corrector: Corrector, blobs: BlobStore
) -> set[int]:
    """Insert the rows of steps no other writer finished meanwhile; their step ids.
    PostgreSQL: one statement that skips the rows another writer got first. SQLite (one writer
    at a time): one insert, or, if it collides after all, the steps one by one."""
    table = cast(Table, models.Correction.__table__)
    if session.get_bind().dialect.name == "postgresql":
        return set(insert_new(session, table, rows, ("step_id", "corrector"), "step_id"))
    try:
        with session.begin_nested():
            insert_many(session, table, rows)
        return {r["step_id"] for r in rows}
    except IntegrityError:
        name = rows[0]["corrector"]
        todo = [r["step_id"] for r in rows if _existing(session, r["step_id"], name) is None]
        for sid in todo:
            record_correction(session, sid, name, corrector, blobs)
        return set()  # counted by record_correction


def _requests(
    session: Session, steps: list[models.Step], tasks: dict[int, str], blobs: BlobStore
) -> dict[int, Callable[[], CorrectionRequest]]:
    """Each step's correction request (as ``request_for_step``), from one query for the actions
    taken earlier in the steps' episodes; each distinct frame read once."""
    taken: dict[int, list[tuple[int, str | None]]] = {}
    for episode_id, idx, action in session.execute(
        select(models.Step.episode_id, models.Step.idx, models.Step.parsed_action)
        .where(models.Step.episode_id.in_({st.episode_id for st in steps}))
        .order_by(models.Step.episode_id, models.Step.idx)
    ):
        taken.setdefault(episode_id, []).append((idx, action))
    images: dict[str, str] = {}

    def image(sha: str | None) -> str | None:
        if sha and sha not in images:
            images[sha] = base64.b64encode(blobs.get(sha)).decode()
        return images.get(sha) if sha else None

    def request(st: models.Step) -> CorrectionRequest:
        history = [a or "" for i, a in taken.get(st.episode_id, []) if i < st.idx]
        return CorrectionRequest.model_validate(
            {
                "task": tasks[st.run_id],
                "image_png_b64": image(st.image_sha),
                "prompt": st.prompt,
                "output": st.output,
                "state": st.state or None,
                "history": history[-200:],
            }
        )

    return {st.id: (lambda st=st: request(st)) for st in steps}  # type: ignore[misc]


def _count_corrected_many(
    session: Session, steps: dict[int, models.Step], rows: list[dict[str, Any]], written: set[int]
) -> None:
    """``count_corrected`` for the rows this batch wrote: one increment per episode."""
    per_episode: dict[int, int] = {}
    for r in rows:
        if r["step_id"] in written and r["status"] == "done" and r["verdict"] == "incorrect":
            eid = steps[r["step_id"]].episode_id
            per_episode[eid] = per_episode.get(eid, 0) + 1
    if per_episode:
        episodes = cast(Table, models.Episode.__table__)
        session.execute(
            update(episodes)
            .where(episodes.c.id == bindparam("eid"))
            .values(corrected_steps=episodes.c.corrected_steps + bindparam("n")),
            # In id order, as the controller's recorder locks them: no deadlock between the two.
            [{"eid": e, "n": n} for e, n in sorted(per_episode.items())],
        )
