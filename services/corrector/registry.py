"""The corrector registry: create, list, change, delete, test, and per-corrector statistics."""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from services.corrector.base import CallTrace, CorrectorError
from services.corrector.egress import public_error
from services.corrector.keys import encrypt_key
from services.corrector.remote import SCHEMA_LEVELS, Honoured, OpenAICorrector
from services.corrector.rows import InvalidCorrector, RegistryError, check_row
from services.corrector.schemas import (
    CorrectorCreate,
    CorrectorOut,
    CorrectorPatch,
    CorrectorStats,
    CorrectorTestResult,
    ProbeStep,
)
from services.corrector.service import ORACLE, corrector_from_row
from shared.db import models
from shared.schemas import CorrectionRequest
from shared.settings import Settings

log = logging.getLogger("gtr.corrector")
STATS_WINDOW = 10_000  # latency statistics over the latest corrections only


class DuplicateName(RegistryError):
    status_code = 409


class CorrectorNotFound(RegistryError):
    status_code = 404


def create_corrector(
    session: Session, body: CorrectorCreate, team: str, settings: Settings
) -> models.Corrector:
    if body.name == ORACLE:
        raise DuplicateName("'oracle' is the built-in corrector's name")
    row = models.Corrector(
        name=body.name,
        kind=body.kind,
        base_url=body.base_url,
        model=body.model,
        params=body.params,
        api_key_env=body.api_key_env,
        team=team,
        shared=body.shared,
    )
    if body.api_key is not None and body.api_key.get_secret_value():
        row.api_key_encrypted = encrypt_key(body.api_key.get_secret_value(), settings)
    check_row(row, settings)
    if session.scalar(select(models.Corrector.id).where(models.Corrector.name == body.name)):
        raise DuplicateName(f"a corrector named '{body.name}' exists")
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError as e:  # a concurrent create of the same name
        raise DuplicateName(f"a corrector named '{body.name}' exists") from e
    return row


def list_correctors(session: Session, token: models.ApiToken) -> Sequence[models.Corrector]:
    query = select(models.Corrector).order_by(models.Corrector.id)
    if token.scope != "admin":
        query = query.where(models.Corrector.team == token.team)
    return session.scalars(query).all()


def get_corrector(session: Session, token: models.ApiToken, corrector_id: int) -> models.Corrector:
    row = session.get(models.Corrector, corrector_id)
    if row is None or (token.scope != "admin" and row.team != token.team):
        raise CorrectorNotFound(f"corrector {corrector_id} not found")
    return row


def update_corrector(
    session: Session, row: models.Corrector, patch: CorrectorPatch, settings: Settings
) -> models.Corrector:
    changes = patch.model_dump(exclude_unset=True)
    for field in ("base_url", "model", "params", "api_key_env"):
        if field in changes:
            setattr(row, field, changes[field] if changes[field] != "" else None)
    if changes.get("shared") is not None:
        row.shared = bool(changes["shared"])
    if "api_key" in changes:
        raw = patch.api_key.get_secret_value() if patch.api_key is not None else ""
        row.api_key_encrypted = encrypt_key(raw, settings) if raw else None
    check_row(row, settings)
    corrector_id = row.id
    try:
        session.flush()
    except StaleDataError as e:  # deleted by a concurrent request since we read it
        session.rollback()
        raise CorrectorNotFound(f"corrector {corrector_id} not found") from e
    return row


def to_out(row: models.Corrector) -> CorrectorOut:
    return CorrectorOut(
        id=row.id,
        name=row.name,
        kind=row.kind,
        base_url=row.base_url,
        model=row.model,
        params=row.params or {},
        api_key_set=bool(row.api_key_encrypted),
        api_key_env=row.api_key_env,
        team=row.team,
        shared=bool(row.shared),
        created_at=row.created_at,
    )


def sample_request(task: str, seed: int) -> CorrectionRequest:
    """A request for a freshly rendered state, answered by the expert (a known-good thought)."""
    from PIL import Image

    from services.env import make_env
    from services.env.expert import expert_output, format_output

    try:
        env = make_env(task, None, seed)
    except (ValueError, KeyError, OSError, ImportError) as e:
        # e.g. ALFWorld without its games on this server: the caller's choice, not a crash.
        raise InvalidCorrector(f"cannot render a sample {task} state here: {str(e)[:200]}") from e
    try:
        obs, _ = env.reset(seed=seed)
        game: Any = env.unwrapped
        state = game.state()
        buf = io.BytesIO()
        Image.fromarray(obs).save(buf, format="PNG")
        return CorrectionRequest.model_validate(
            {
                "task": task,
                "image_png_b64": base64.b64encode(buf.getvalue()).decode(),
                "prompt": game.prompt(),
                "output": format_output(expert_output(task, state)),
                "state": state,
            }
        )
    finally:
        env.close()


def try_corrector(
    row: models.Corrector, settings: Settings, task: str, seed: int, probe: bool = False
) -> CorrectorTestResult:
    """One sample correction without retries; reports the verdict and latency, or the error.
    ``probe``: first find out which structured output the endpoint enforces (a few requests)."""
    sample = sample_request(task, seed)
    start = time.perf_counter()
    trace = CallTrace()
    structured = None
    steps: list[ProbeStep] = []
    try:
        corrector = corrector_from_row(row, settings, overrides={"max_retries": 0})
        if probe and isinstance(corrector, OpenAICorrector):  # what the server honours
            found = corrector.probe(trace)
            structured = describe_probe(found)
            steps = probe_steps(found)
        result = corrector.correct(sample, trace)
    except CorrectorError as e:
        # A category, never the remote's error text: /test must not read other hosts' answers
        # back. The model's own answer (raw) is shown: it is what the user came to debug.
        return CorrectorTestResult(
            ok=False,
            latency_ms=_ms(start),
            error=public_error(e),
            raw=(e.raw or trace.raw) if e.kind != "transport" else None,
            tokens=trace.tokens,
            attempts=trace.attempts,
            structured=structured,
            probe=steps,
        )
    except Exception:  # noqa: BLE001 - e.g. a stored key no HTTP header can carry
        log.exception("sample call of corrector %s failed", row.name)
        return CorrectorTestResult(
            ok=False, latency_ms=_ms(start), error="error: the sample call failed (server log)"
        )
    return CorrectorTestResult(
        ok=True,
        verdict=result.verdict,
        corrected_thought=result.corrected_thought,
        latency_ms=_ms(start),
        tokens=result.tokens,
        raw=trace.raw,
        attempts=trace.attempts,
        structured=structured,
        probe=steps,
    )


def probe_steps(found: list[Honoured]) -> list[ProbeStep]:
    """The probe level by level, each with its reason as a category (as ``/test`` errors)."""
    return [
        ProbeStep(
            level=h.level, outcome=h.outcome, reason=public_error(h.error) if h.error else None
        )
        for h in found
    ]


def describe_probe(found: list[Honoured]) -> str:
    """One plain line: what the endpoint did at each level, and what the corrector does now.
    A failure is named by its category only, never the remote's words (as ``/test``)."""
    if not found:
        return "structured output: not asked for (params.structured = none)"
    said = ", ".join(f"{h.level} {h.outcome}" for h in found)
    last = found[-1]
    if last.outcome == "failed":
        why = public_error(last.error) if last.error else "no answer"
        return f"structured output: {said} ({why}); not known"
    if last.outcome == "enforced" and last.level in SCHEMA_LEVELS:
        return f"structured output: {said}: the answer's schema is enforced with {last.level}"
    if last.outcome == "enforced":
        return (
            f"structured output: {said}: JSON is enforced, the schema is NOT; the prompt "
            "carries the schema and a worked example"
        )
    return (
        f"structured output: {said}: the schema is NOT enforced by this server; the prompt "
        "carries the schema and a worked example, and answers are parsed from free text"
    )


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def corrector_stats(session: Session, name: str, team: str | None = None) -> CorrectorStats:
    """Counts by status, failure rate, latency mean/p95 of the latest corrections (``team``: of
    that team's runs only, for a built-in corrector every team uses)."""
    where = models.Correction.corrector == name
    if team is not None:
        runs = select(models.Run.id).where(models.Run.team == team)
        where = where & models.Correction.run_id.in_(runs)
    counts = dict(
        session.execute(
            select(models.Correction.status, func.count())
            .where(where)
            .group_by(models.Correction.status)
        ).all()
    )
    done, failed = counts.get("done", 0), counts.get("failed", 0)
    incorrect = session.scalar(
        select(func.count()).where(where, models.Correction.verdict == "incorrect")
    )
    tokens = session.scalar(
        select(func.coalesce(func.sum(models.Correction.tokens), 0)).where(where)
    )
    latencies = sorted(
        x
        for x in session.scalars(
            select(models.Correction.latency_ms)
            .where(
                where, models.Correction.status == "done", models.Correction.latency_ms.is_not(None)
            )
            .order_by(models.Correction.id.desc())
            .limit(STATS_WINDOW)
        ).all()
        if x is not None
    )
    n = len(latencies)
    return CorrectorStats(
        corrector=name,
        total=sum(counts.values()),
        done=done,
        failed=failed,
        pending=counts.get("pending", 0),
        failure_rate=failed / (done + failed) if done + failed else None,
        incorrect_rate=(incorrect or 0) / done if done else None,
        latency_mean_ms=sum(latencies) / n if n else None,
        latency_p95_ms=latencies[min(n - 1, int(0.95 * n))] if n else None,
        tokens=int(tokens or 0),
    )
