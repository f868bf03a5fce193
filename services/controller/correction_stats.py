"""Correction figures of a run: done / failed / skipped by kind, per update and in total.

Corrections arrive after their update was trained (``corrector.wait = "none"``), so an update's
figures are recomputed whenever one of its corrections finishes later, never kept as the
snapshot taken when the update ended. More than half failed or skipped over an update raises
``corrections_alarm`` in its metrics (the run page, the progress line and the summary show it).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.db.models import Correction, CorrectorSpend, Run, Step, Update
from shared.schemas import RunConfig

# The run's totals kept on its record (``runs.info["corrections"]``) when it ends.
RECORDED = (
    "corrections",
    "corrections_done",
    "corrections_failed",
    "corrections_skipped",
    "corrections_late",
    "corrections_coverage",
    "corrections_in_time",
    "corrections_lag",
    "corrections_lag_max",
    "corrections_unused",
    "corrector_calls",
)
PREFIX = "corrections"  # every key written here starts with it, or with "corrector_"
ALARM_SHARE = 0.5  # failed + skipped above this share of an update's finished corrections
ACCURACY = "corrector/accuracy"  # share of answers the exact judge agrees with (issue 40)


def failure_kind(error: str | None) -> str:
    """The kind an error starts with (``malformed: ...`` -> ``malformed``)."""
    head = (error or "").split(":", 1)[0].strip()
    return head if head.isidentifier() else "error"


# Not failures: the corrector was not too broken but too slow for the run (skipped), or the run
# ended before the answer could teach any update (late). Coverage counts them, the verdict not.
NOT_FAILURES = ("skipped", "late")


@dataclass(frozen=True)
class Timeline:
    """When each update's rollout went to the trainer (``updates.created_at``, by index) and
    how many updates the run plans: what a correction's arrival is measured against."""

    trained: dict[int, datetime]
    num_updates: int | None = None

    def lag(self, update_idx: int, finished_at: datetime | None) -> int | None:
        """Updates trained between a step's rollout and its correction's arrival: 0 = in time
        for its own update; k = first trained on (DAgger buffer) by update ``update_idx + k``."""
        if finished_at is None:
            return None
        at = _naive(finished_at)
        return sum(1 for j, t in self.trained.items() if j >= update_idx and _naive(t) < at)


def _naive(t: datetime) -> datetime:
    return t.replace(tzinfo=None) if t.tzinfo is None else t.astimezone(UTC).replace(tzinfo=None)


def figures(
    rows: list[Any], timeline: Timeline | None = None, requested: int | None = None
) -> dict[str, float]:
    """Figures of some corrections; each row has status, verdict, latency_ms, tokens, error
    (and update_idx, finished_at for the lag). ``requested``: the well-formed steps queued for
    correction (a row is written only when its correction ends: the others are pending).
    Coverage: the share of the requested ones done; lag: ``Timeline.lag``."""
    asked = max(len(rows), requested or 0)
    done = [r for r in rows if r.status == "done"]
    failed = [r for r in rows if r.status == "failed"]
    kinds = Counter(failure_kind(r.error) for r in failed)
    spared = {k: kinds.pop(k, 0) for k in NOT_FAILURES}
    real = len(failed) - sum(spared.values())
    out: dict[str, float] = {
        "corrections": float(asked),
        "corrections_done": float(len(done)),
        "corrections_failed": float(real),
        "corrections_skipped": float(spared["skipped"]),
        "corrections_late": float(spared["late"]),
        "corrections_pending": float(asked - len(done) - len(failed)),
    }
    out.update({f"corrections_failed/{k}": float(n) for k, n in sorted(kinds.items())})
    if asked:
        out["corrections_coverage"] = len(done) / asked
    if timeline is not None and done:
        lags = [timeline.lag(r.update_idx, getattr(r, "finished_at", None)) for r in done]
        known = [x for x in lags if x is not None]
        if known:
            out["corrections_lag"] = sum(known) / len(known)
            out["corrections_lag_max"] = float(max(known))
            # The share of the requested corrections its own update trained with.
            out["corrections_in_time"] = sum(x == 0 for x in known) / asked
            n = timeline.num_updates
            if n is not None:  # arrived after the run's last update trained: taught nothing
                unused = sum(r.update_idx + x >= n for r, x in zip(done, lags, strict=True) if x)
                out["corrections_unused"] = float(unused)
    finished = len(done) + len(failed)
    if finished:
        out["corrections_failed_rate"] = real / finished
        out["corrections_alarm"] = float(real / finished > ALARM_SHARE)
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


def requested(s: Session, run_id: int, update_idx: int | None = None) -> int:
    """The run's (or one update's) well-formed steps: each was queued for correction."""
    where = [Step.run_id == run_id, Step.format_valid.is_(True)]
    if update_idx is not None:
        where.append(Step.update_idx == update_idx)
    return int(s.scalar(select(func.count()).select_from(Step).where(*where)) or 0)


def timeline(s: Session, run_id: int) -> Timeline:
    rows = s.execute(select(Update.idx, Update.created_at).where(Update.run_id == run_id))
    trained = {int(i): t for i, t in rows}
    run = s.get(Run, run_id)
    n = ((run.config or {}).get("train") or {}).get("num_updates") if run is not None else None
    return Timeline(trained, int(n) if isinstance(n, int) else None)


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
        Correction.finished_at,
        func.substr(Correction.error, 1, 40).label("error"),
    )
    return list(s.execute(select(*cols).where(Correction.run_id == run_id, *where)))


def update_figures(
    s: Session, run_id: int, update_idx: int, line: Timeline | None = None
) -> dict[str, float]:
    rows = _rows(s, run_id, Correction.update_idx == update_idx)
    return figures(rows, line or timeline(s, run_id), requested(s, run_id, update_idx))


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
    line = timeline(s, run_id)
    for row in rows:
        fresh = update_figures(s, run_id, row.idx, line)
        kept = {k: v for k, v in row.metrics.items() if not k.startswith(PREFIX)}
        row.metrics = {**kept, **fresh}  # a new dict: the JSON column sees the change
    return len(rows)


def run_totals(s: Session, run_id: int) -> dict[str, float]:
    """The whole run's figures, and the calls its corrector was sent (retries and duplicate
    deliveries included: ``corrector_calls`` above ``corrections`` is what they cost)."""
    out = figures(_rows(s, run_id), timeline(s, run_id), requested(s, run_id))
    calls = s.scalar(
        select(func.coalesce(func.sum(CorrectorSpend.calls), 0)).where(
            CorrectorSpend.run_id == run_id
        )
    )
    out["corrector_calls"] = float(calls or 0)
    return out


def failure_reasons(
    s: Session, run_id: int, most: int = 3, real: bool = False
) -> list[tuple[str, int]]:
    """The run's commonest failure reasons with their counts, details in brackets dropped
    (``malformed: answer is not JSON (Expecting value ...)`` -> ``malformed: answer is not
    JSON``), so that a few lines say why the corrections failed."""
    errors = s.scalars(
        select(func.substr(Correction.error, 1, 200)).where(
            Correction.run_id == run_id, Correction.status == "failed"
        )
    )
    counts = Counter(_REASON_DETAIL.sub("", e or "").strip() or "error" for e in errors)
    if real:  # the real failures only (not skipped, not late)
        counts = Counter({k: n for k, n in counts.items() if failure_kind(k) not in NOT_FAILURES})
    return counts.most_common(most)


def reasons_text(reasons: list[tuple[str, int]]) -> str:
    """``malformed: answer is not JSON (12); timeout: no answer within 60 s (3)``"""
    return "; ".join(f"{why} ({n})" for why, n in reasons)


def degraded_reason(s: Session, run_id: int, share: float, min_coverage: float = 0.0) -> str | None:
    """Why a run that went to its end is ``degraded``: more than ``share`` of its requested
    corrections really failed (transport, malformed, refused, budget, lost: not the ones
    skipped or too late to teach an update), or it ended below ``min_coverage``. None when not."""
    totals = run_totals(s, run_id)
    asked = totals["corrections"]
    bad = totals["corrections_failed"]
    if asked and bad / asked > share:
        return (
            f"degraded: {bad:.0f} of {asked:.0f} requested corrections failed "
            f"(over corrector.degraded_share = {share:g}): "
            + reasons_text(failure_reasons(s, run_id, real=True))
        )
    cov = totals.get("corrections_coverage", 1.0)
    if asked and min_coverage and cov < min_coverage:
        return (
            f"degraded: {totals['corrections_done']:.0f} of {asked:.0f} requested corrections "
            f"done ({cov:.0%}, under corrector.min_coverage = {min_coverage:g})"
        )
    return None


def final_status(
    s: Session, run_id: int, cfg: RunConfig, status: str, error: str | None
) -> tuple[str, str | None]:
    """The status a run ends with: a run that went to its end while most of its corrections
    failed (``degraded_reason``) ends ``degraded``, with the reason as its error."""
    if status != "completed" or not cfg.uses_corrector:
        return status, error
    c = cfg.corrector
    why = degraded_reason(s, run_id, c.degraded_share, c.min_coverage)
    return ("degraded", why) if why else (status, error)


_REASON_DETAIL = re.compile(r"\s*\(.*$", re.DOTALL)  # the first bracket on: instance details


def describe(m: dict[str, Any]) -> str:
    """``12 done, 30 failed (malformed 28, timeout 2), 5 skipped; coverage 25%, lag 0.4 (max
    2)`` for a progress line."""
    if not m.get("corrections"):
        return "none yet"
    kinds = [
        f"{k.split('/', 1)[1]} {int(v)}"
        for k, v in sorted(m.items())
        if k.startswith("corrections_failed/") and v
    ]
    text = f"{int(m.get('corrections_done', 0))} done, {int(m.get('corrections_failed', 0))} failed"
    text += f" ({', '.join(kinds)})" if kinds else ""
    for key in ("skipped", "late", "pending"):
        if m.get(f"corrections_{key}"):
            text += f", {int(m[f'corrections_{key}'])} {key}"
    return text + coverage_text(m)


def coverage_text(m: dict[str, Any]) -> str:
    """``; coverage 96% (in time 80%), lag 0.3 (max 2)``: "" without corrections."""
    if not m.get("corrections") or "corrections_coverage" not in m:
        return ""
    text = f"; coverage {m['corrections_coverage']:.0%}"
    if "corrections_in_time" in m:
        text += f" (in time {m['corrections_in_time']:.0%})"
    if "corrections_lag" in m:
        text += f", lag {m['corrections_lag']:.1f} (max {int(m.get('corrections_lag_max', 0))})"
    if m.get("corrections_unused"):
        text += f", {int(m['corrections_unused'])} after the last update"
    return text
