"""Corrector service: build a corrector by name, and record one correction per step.

`record_correction` is what both the embedded thread pool and the Celery task call: it loads the
step, calls the corrector, and writes the result (or the failure and its reason) exactly once per
step and corrector.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.corrector.base import CallTrace, Corrector, CorrectorError
from services.corrector.egress import stored_error
from services.corrector.keys import decrypt_key
from services.corrector.oracle import OracleCorrector
from services.corrector.remote import HttpCorrector, OpenAICorrector, RemoteParams
from services.corrector.resilience import Budget, BudgetExceeded
from services.corrector.rows import RegistryError, inline_row
from services.corrector.spend import run_budget
from shared.db import models
from shared.db.models import utcnow
from shared.schemas import SELF_TEACHER, CorrectionRequest
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
) -> Corrector:
    """'oracle' or 'self_teacher' (built in; the latter serves run ``run_id``), the run config's
    `inline` one, or a registered corrector by name; with `team` (the run's), only one of that
    team's or a shared one: another team's key never serves this team's steps."""
    if inline is not None:
        try:
            made = inline_row(inline, settings)
        except RegistryError as e:
            raise CorrectorError("config", f"the run's inline corrector: {e}") from e
        return corrector_from_row(made, settings, noise=noise, seed=seed, budget=budget)
    if name == ORACLE:
        return OracleCorrector(noise=noise, seed=seed)
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
        return OracleCorrector(noise=float((row.params or {}).get("noise", noise)), seed=seed)
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
    session.refresh(row)
    return row


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
    budget = run_budget(session, step.run_id, name)

    def wanted() -> bool:
        """Once the endpoint has a slot: still unsettled? (`on_send`: it leaves the backlog)"""
        row = _existing(session, step.id, name)
        if row is not None and row.status != "pending":
            return False
        if on_send is not None:
            on_send()
        return True

    trace = CallTrace(budget=budget, wanted=wanted)
    start = time.perf_counter()
    try:
        if budget is not None:
            budget.check()  # spent already: no request is even built
        correction = corrector.correct(request_for_step(session, step, blobs), trace)
    except CorrectorError as e:
        return _failure(step, name, trace, start, stored_error(e), e.raw)
    except Exception as e:  # noqa: BLE001 - a corrector bug becomes a recorded failure, not a crash
        log.exception("corrector %s crashed on step %s", name, step.id)
        return _failure(step, name, trace, start, f"error: {type(e).__name__}: {str(e)[:500]}")
    return {
        "status": "done",
        "verdict": correction.verdict,
        "corrected_thought": correction.corrected_thought,
        "extras": correction.extras,
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
    log.warning("correction of step %s by %s failed: %s", step.id, name, error)
    return {
        "status": "failed",
        "error": error,
        "raw": (raw or trace.raw or "")[:20_000] or None,
        "tokens": trace.tokens,
        "attempts": trace.attempts,
        "latency_ms": (time.perf_counter() - start) * 1000,
        "finished_at": utcnow(),
    }
