"""Correction figures of a run: done / failed / skipped by kind, per update and in total.

Corrections arrive after their update was trained (``corrector.wait = "none"``), so an update's
figures are recomputed whenever one of its corrections finishes later, never kept as the
snapshot taken when the update ended. More than half failed or skipped over an update raises
``corrections_alarm`` in its metrics (the run page, the progress line and the summary show it).
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.db.models import Correction, CorrectorSpend, Update
from shared.schemas import RunConfig

PREFIX = "corrections"  # every key written here starts with it, or with "corrector_"
ALARM_SHARE = 0.5  # failed + skipped above this share of an update's finished corrections
ACCURACY = "corrector/accuracy"  # share of answers the exact judge agrees with (issue 40)


def failure_kind(error: str | None) -> str:
    """The kind an error starts with (``malformed: ...`` -> ``malformed``)."""
    head = (error or "").split(":", 1)[0].strip()
    return head if head.isidentifier() else "error"


def figures(rows: list[Any]) -> dict[str, float]:
    """Figures of some corrections; each row has status, verdict, latency_ms, tokens, error."""
    done = [r for r in rows if r.status == "done"]
    failed = [r for r in rows if r.status == "failed"]
    kinds = Counter(failure_kind(r.error) for r in failed)
    skipped = kinds.pop("skipped", 0)
    out: dict[str, float] = {
        "corrections": float(len(rows)),
        "corrections_done": float(len(done)),
        "corrections_failed": float(len(failed) - skipped),
        "corrections_skipped": float(skipped),
        "corrections_pending": float(len(rows) - len(done) - len(failed)),
    }
    out.update({f"corrections_failed/{k}": float(n) for k, n in sorted(kinds.items())})
    finished = len(done) + len(failed)
    if finished:
        out["corrections_failed_rate"] = len(failed) / finished
        out["corrections_alarm"] = float(len(failed) / finished > ALARM_SHARE)
    if done:
        out["corrected_rate"] = sum(r.verdict == "incorrect" for r in done) / len(done)
        lat = [r.latency_ms for r in done if r.latency_ms is not None]
        out["corrector_latency_ms"] = sum(lat) / len(lat) if lat else 0.0
        # Agreement with the exact judge (services/corrector/oracle.py `accurate`), where judged.
        marks = [_accurate(r) for r in done]
        judged = [m for m in marks if m is not None]
        if judged:
            out[ACCURACY] = sum(judged) / len(judged)
    out["corrector_tokens"] = float(sum(r.tokens or 0 for r in rows))
    return out


def _accurate(row: Any) -> bool | None:
    extras = getattr(row, "extras", None)
    mark = extras.get("accurate") if isinstance(extras, dict) else None
    return mark if isinstance(mark, bool) else None


def _rows(s: Session, run_id: int, *where: Any) -> list[Any]:
    cols = (
        Correction.update_idx,
        Correction.extras,
        Correction.status,
        Correction.verdict,
        Correction.latency_ms,
        Correction.tokens,
        func.substr(Correction.error, 1, 40).label("error"),
    )
    return list(s.execute(select(*cols).where(Correction.run_id == run_id, *where)))


def update_figures(s: Session, run_id: int, update_idx: int) -> dict[str, float]:
    return figures(_rows(s, run_id, Correction.update_idx == update_idx))


def refresh_late(s: Session, run_id: int, since: datetime | None, before: int | None) -> int:
    """Recomputes the figures of the updates (before ``before``, when given) that had a
    correction finish at or after ``since`` (None: all). Returns how many were rewritten."""
    query = select(Correction.update_idx).distinct().where(Correction.run_id == run_id)
    if since is not None:
        query = query.where(Correction.finished_at >= since)
    if before is not None:
        query = query.where(Correction.update_idx < before)
    idxs = list(s.scalars(query))
    if not idxs:
        return 0
    rows = s.scalars(select(Update).where(Update.run_id == run_id, Update.idx.in_(idxs))).all()
    for row in rows:
        fresh = update_figures(s, run_id, row.idx)
        kept = {k: v for k, v in row.metrics.items() if not k.startswith(PREFIX)}
        row.metrics = {**kept, **fresh}  # a new dict: the JSON column sees the change
    return len(rows)


def run_totals(s: Session, run_id: int) -> dict[str, float]:
    """The whole run's figures, and the calls its corrector was sent (retries and duplicate
    deliveries included: ``corrector_calls`` above ``corrections`` is what they cost)."""
    out = figures(_rows(s, run_id))
    calls = s.scalar(
        select(func.coalesce(func.sum(CorrectorSpend.calls), 0)).where(
            CorrectorSpend.run_id == run_id
        )
    )
    out["corrector_calls"] = float(calls or 0)
    return out


def failure_reasons(s: Session, run_id: int, most: int = 3) -> list[tuple[str, int]]:
    """The run's commonest failure reasons with their counts, details in brackets dropped
    (``malformed: answer is not JSON (Expecting value ...)`` -> ``malformed: answer is not
    JSON``), so that a few lines say why the corrections failed."""
    errors = s.scalars(
        select(func.substr(Correction.error, 1, 200)).where(
            Correction.run_id == run_id, Correction.status == "failed"
        )
    )
    counts = Counter(_REASON_DETAIL.sub("", e or "").strip() or "error" for e in errors)
    return counts.most_common(most)


def reasons_text(reasons: list[tuple[str, int]]) -> str:
    """``malformed: answer is not JSON (12); timeout: no answer within 60 s (3)``"""
    return "; ".join(f"{why} ({n})" for why, n in reasons)


def degraded_reason(s: Session, run_id: int, share: float) -> str | None:
    """Why a run that went to its end is ``degraded``: more than ``share`` of its requested
    corrections failed or were skipped, so it did not train as GTR. None when it is not."""
    totals = run_totals(s, run_id)
    asked = totals["corrections"]
    bad = totals["corrections_failed"] + totals["corrections_skipped"]
    if not asked or bad / asked <= share:
        return None
    return (
        f"degraded: {bad:.0f} of {asked:.0f} requested corrections failed or were skipped "
        f"(over corrector.degraded_share = {share:g}): " + reasons_text(failure_reasons(s, run_id))
    )


def final_status(
    s: Session, run_id: int, cfg: RunConfig, status: str, error: str | None
) -> tuple[str, str | None]:
    """The status a run ends with: a run that went to its end while most of its corrections
    failed (``degraded_reason``) ends ``degraded``, with the reason as its error."""
    if status != "completed" or not cfg.uses_corrector:
        return status, error
    why = degraded_reason(s, run_id, cfg.corrector.degraded_share)
    return ("degraded", why) if why else (status, error)


_REASON_DETAIL = re.compile(r"\s*\(.*$", re.DOTALL)  # the first bracket on: instance details


def describe(m: dict[str, Any]) -> str:
    """``12 done, 30 failed (malformed 28, timeout 2), 5 skipped`` for a progress line."""
    if not m.get("corrections"):
        return "none yet"
    kinds = [
        f"{k.split('/', 1)[1]} {int(v)}"
        for k, v in sorted(m.items())
        if k.startswith("corrections_failed/") and v
    ]
    text = f"{int(m.get('corrections_done', 0))} done, {int(m.get('corrections_failed', 0))} failed"
    text += f" ({', '.join(kinds)})" if kinds else ""
    if m.get("corrections_skipped"):
        text += f", {int(m['corrections_skipped'])} skipped"
    if m.get("corrections_pending"):
        text += f", {int(m['corrections_pending'])} pending"
    return text
