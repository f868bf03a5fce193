"""Step search: a run's steps filtered by verdict, format, action, reward, update and text.

Full text runs on PostgreSQL's GIN indexes over ``to_tsvector('english', …)`` of the thought and
the corrected thought (migration 0003); on SQLite (embedded) it is a case-insensitive LIKE.
Results come in step-id order; the total is counted up to ``COUNT_CAP`` so that a page answers
fast on runs of millions of steps ("10,000+" beyond).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from sqlalchemy import exists, func, literal, select, union
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from shared.db.models import Correction, Run, Step

COUNT_CAP = 10_000
EXPORT_CAP = 100_000  # rows of one export; narrow the search for more
TS_CONFIG = "english"  # must match the indexes of migration 0003

Verdict = Literal["corrected", "correct", "failed", "pending", "none"]


class StepFilter(BaseModel):
    """What a step search asks for; every field optional (none: every step of the run)."""

    verdict: Verdict | None = Field(
        None,
        description="corrected: the corrector disagreed; correct: it agreed; failed: the "
        "correction failed; pending: not back yet; none: never sent (e.g. malformed output)",
    )
    format_valid: bool | None = Field(None, description="Whether the output parsed (JSON format)")
    action: str | None = Field(None, max_length=200, description="The executed action, exactly")
    reward_min: float | None = Field(None, ge=-1e9, le=1e9, description="Reward at least this")
    reward_max: float | None = Field(None, ge=-1e9, le=1e9, description="Reward at most this")
    update: int | None = Field(None, ge=0, le=2**31 - 1, description="Only this update")
    q: str | None = Field(
        None, max_length=200, description="Words searched in thoughts and corrected thoughts"
    )

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, data: Any) -> Any:
        """A form sends its empty fields as '': they mean 'any'."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and not v.strip())}
        return data

    def query_string(self) -> dict[str, str]:
        """The filters set, as URL query parameters (permalinks, pager, export links)."""
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in self.model_dump().items()
            if v is not None and v != ""
        }


def _text(session: Session, run_id: int, q: str) -> Any:
    """Step ids of the run whose thought or corrected thought holds the words of ``q``."""
    if session.get_bind().dialect.name == "postgresql":
        tsq = func.plainto_tsquery(TS_CONFIG, q)
        in_steps = select(Step.id).where(
            Step.run_id == run_id,
            func.to_tsvector(TS_CONFIG, func.coalesce(Step.thought, "")).op("@@")(tsq),
        )
        in_corr = select(Correction.step_id).where(
            Correction.run_id == run_id,
            func.to_tsvector(TS_CONFIG, func.coalesce(Correction.corrected_thought, "")).op("@@")(
                tsq
            ),
        )
    else:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        in_steps = select(Step.id).where(
            Step.run_id == run_id, Step.thought.ilike(pattern, escape="\\")
        )
        in_corr = select(Correction.step_id).where(
            Correction.run_id == run_id, Correction.corrected_thought.ilike(pattern, escape="\\")
        )
    return union(in_steps, in_corr)


def _verdict(run_id: int, verdict: str) -> Any:
    corr = select(Correction.step_id).where(Correction.run_id == run_id)
    if verdict == "corrected":
        return Step.id.in_(
            corr.where(Correction.verdict == "incorrect", Correction.status == "done")
        )
    if verdict == "correct":
        return Step.id.in_(corr.where(Correction.verdict == "correct", Correction.status == "done"))
    if verdict in ("failed", "pending"):
        return Step.id.in_(corr.where(Correction.status == verdict))
    return ~exists().where(Correction.step_id == Step.id)


def search_query(session: Session, run: Run, f: StepFilter) -> Select:
    query = select(Step).where(Step.run_id == run.id)
    if f.update is not None:
        query = query.where(Step.update_idx == f.update)
    if f.verdict:
        query = query.where(_verdict(run.id, f.verdict))
    if f.format_valid is not None:
        query = query.where(Step.format_valid.is_(f.format_valid))
    if f.action:
        query = query.where(Step.parsed_action == f.action)
    if f.reward_min is not None:
        query = query.where(Step.reward >= f.reward_min)
    if f.reward_max is not None:
        query = query.where(Step.reward <= f.reward_max)
    if f.q and f.q.strip():
        query = query.where(Step.id.in_(_text(session, run.id, f.q.strip())))
    return query


def search_steps(
    session: Session, run: Run, f: StepFilter, limit: int, offset: int
) -> tuple[Sequence[Step], int, bool]:
    """A page of matching steps, the total (capped), and whether the cap cut the count."""
    query = search_query(session, run, f)
    capped = query.with_only_columns(literal(1)).limit(COUNT_CAP + 1).subquery()
    total = int(session.scalar(select(func.count()).select_from(capped)) or 0)
    rows = session.scalars(query.order_by(Step.id).limit(limit).offset(offset)).all()
    return rows, min(total, COUNT_CAP), total > COUNT_CAP


def verdicts(session: Session, step_ids: list[int]) -> dict[int, Correction]:
    """The (one) correction of each step, for the verdict column."""
    if not step_ids:
        return {}
    rows = session.scalars(select(Correction).where(Correction.step_id.in_(step_ids)))
    return {c.step_id: c for c in rows}


def verdict_of(c: Correction | None) -> str:
    if c is None:
        return "none"
    if c.status != "done":
        return c.status
    return "corrected" if c.verdict == "incorrect" else "correct"


EXPORT_COLUMNS = (
    "step_id", "episode_id", "update", "idx", "action", "format_valid", "action_valid",
    "reward", "done", "value", "verdict", "thought", "corrected_thought", "reasoning",
)  # fmt: skip


def export_rows(session: Session, run: Run, f: StepFilter) -> Iterator[dict[str, Any]]:
    """Every matching step (up to EXPORT_CAP) as a flat record, in pages of 1,000."""
    query = search_query(session, run, f).order_by(Step.id)
    last, sent = 0, 0
    while sent < EXPORT_CAP:
        rows = session.scalars(
            query.where(Step.id > last).limit(min(1000, EXPORT_CAP - sent))
        ).all()
        if not rows:
            return
        corr = verdicts(session, [s.id for s in rows])
        for s in rows:
            c = corr.get(s.id)
            yield {
                "step_id": s.id, "episode_id": s.episode_id, "update": s.update_idx,
                "idx": s.idx, "action": s.parsed_action, "format_valid": s.format_valid,
                "action_valid": s.action_valid, "reward": s.reward, "done": s.done,
                "value": s.value, "verdict": verdict_of(c), "thought": s.thought,
                "corrected_thought": c.corrected_thought if c else None,
                "reasoning": c.reasoning if c else None,
            }  # fmt: skip
        last, sent = rows[-1].id, sent + len(rows)
