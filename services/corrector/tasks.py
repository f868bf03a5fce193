"""Celery task on queue `corrector`: `corrector.correct(step_id, corrector_name)`."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from services.corrector.base import Corrector
from services.corrector.service import (
    ORACLE,
    build_corrector,
    record_correction,
    record_corrections,
)
from shared.db import models
from shared.db.session import session_scope
from shared.queues import TASK_CORRECT, TASK_CORRECT_BATCH, celery_app
from shared.schemas import SELF_TEACHER
from shared.settings import get_settings

# One corrector per registry row version and run: keeps its semaphore, breaker and clients warm.
_CACHE: dict[str, Corrector] = {}
_CACHE_LOCK = threading.Lock()


def _corrector(session: Any, name: str, run: models.Run | None) -> Corrector:
    cfg = (run.config or {}).get("corrector", {}) if run else {}
    noise, seed = float(cfg.get("noise", 0.0)), int((run.config or {}).get("seed", 0)) if run else 0
    team = run.team if run else None
    inline = cfg if cfg.get("kind") else None
    errors = cfg.get("errors")  # the fallible oracle's rates per kind
    key_parts: list[Any] = [name, noise, seed, team, inline, errors]
    if name == SELF_TEACHER:
        return _self_teacher(session, run)
    if name != ORACLE and inline is None:
        row = session.scalar(select(models.Corrector).where(models.Corrector.name == name))
        if row is not None:
            key_parts += [
                row.id,
                row.kind,
                row.base_url,
                row.model,
                row.params,
                row.api_key_encrypted,
                row.api_key_env,
                row.team,
                row.shared,
            ]
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = build_corrector(
                name,
                session,
                get_settings(),
                noise=noise,
                seed=seed,
                team=team,
                inline=inline,
                errors=errors,
            )
        return _CACHE[key]


@celery_app.task(
    name=TASK_CORRECT,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=5,
)
def correct(step_id: int, corrector_name: str) -> dict[str, Any]:
    """Corrects one step once; a redelivered task finds the row written and calls nothing."""
    with session_scope() as session:
        step = session.get(models.Step, step_id)
        if step is None:
            return {"step_id": step_id, "status": "missing"}
        try:
            corrector = _corrector(session, corrector_name, session.get(models.Run, step.run_id))
        except Exception as e:  # noqa: BLE001 - an unknown name is recorded on the step
            corrector = _Failing(e)
        row = record_correction(session, step_id, corrector_name, corrector)
        return {"step_id": step_id, "correction_id": row.id, "status": row.status}


@celery_app.task(
    name=TASK_CORRECT_BATCH,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=5,
)
def correct_batch(step_ids: list[int], corrector_name: str) -> dict[str, Any]:
    """Corrects the steps of one rollout step (one run) in one transaction; a redelivered
    task finds their rows written and calls nothing. For correctors that answer in process."""
    with session_scope() as session:
        run_id = session.scalar(select(models.Step.run_id).where(models.Step.id.in_(step_ids)))
        if run_id is None:
            return {"step_ids": step_ids, "status": "missing"}
        try:
            corrector = _corrector(session, corrector_name, session.get(models.Run, run_id))
        except Exception as e:  # noqa: BLE001 - an unknown name is recorded on the steps
            corrector = _Failing(e)
        n = record_corrections(session, step_ids, corrector_name, corrector)
        return {"step_ids": step_ids, "corrected": n}


_TEACHERS: dict[int, Corrector] = {}  # run id -> its self-teacher (each holds a model)
MAX_TEACHERS = 2


def _self_teacher(session: Any, run: models.Run | None) -> Corrector:
    """The run's self-teacher, cached per run; the oldest dropped past MAX_TEACHERS."""
    run_id = run.id if run is not None else None
    with _CACHE_LOCK:
        if run_id is None or run_id not in _TEACHERS:
            corrector = build_corrector(SELF_TEACHER, session, get_settings(), run_id=run_id)
            assert run_id is not None  # build_corrector raised otherwise
            while len(_TEACHERS) >= MAX_TEACHERS:
                _TEACHERS.pop(next(iter(_TEACHERS)))
            _TEACHERS[run_id] = corrector
        return _TEACHERS[run_id]


class _Failing:
    """Stands in for a corrector that could not be built, so the failure is recorded."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def correct(self, req: Any, trace: Any = None) -> Any:
        raise self.error
