"""Step search: a run's steps filtered by verdict, format, action, reward, update and text.

Full text runs on PostgreSQL's GIN indexes over ``to_tsvector('english', …)`` of the thought and
the corrected thought (migration 0003); on SQLite (embedded) it is a case-insensitive LIKE.
Results come in step-id order; the total is counted up to ``COUNT_CAP`` (a text search: up to
its page) so that a page answers fast on runs of millions of steps ("1,000+" beyond).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from sqlalchemy import exists, func, literal_column, select
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from shared.db.models import Correction, Run, Step

COUNT_CAP = 1_000
MAX_OFFSET = 10_000  # deeper pages: narrow the search, or export it
EXPORT_CAP = 100_000  # rows of one export; narrow the search for more
TS_CONFIG = "english"
# The indexed expressions of migration 0003, character for character.
STEP_TSV = f"to_tsvector('{TS_CONFIG}', coalesce(steps.thought, ''))"
CORR_TSV = f"to_tsvector('{TS_CONFIG}', coalesce(corrections.corrected_thought, ''))"

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


def _text_branches(session: Session, run_id: int, q: str) -> list[Any]:
    """Conditions on Step: (1) its thought holds the words of ``q``, (2) its corrected thought
    does. Kept apart (not OR-ed) so that each can use its own index: a GIN scan for a rare word,
    the step-id order for a common one, as the planner judges."""
    if session.get_bind().dialect.name == "postgresql":
        # Written as the indexes of migration 0003 are, constants inline (a bound parameter
        # in the expression would not match the index, and every row would be parsed).
        tsq = func.plainto_tsquery(literal_column(f"'{TS_CONFIG}'"), q)
        in_thought = literal_column(STEP_TSV).op("@@")(tsq)
        corr_match = literal_column(CORR_TSV).op("@@")(tsq)
    else:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        in_thought = Step.thought.ilike(pattern, escape="\\")
        corr_match = Correction.corrected_thought.ilike(pattern, escape="\\")
    corrected = select(Correction.step_id).where(Correction.run_id == run_id, corr_match)
    return [in_thought, Step.id.in_(corrected)]


def _verdict(run_id: int, verdict: str, update: int | None) -> Any:
    corr = select(Correction.step_id).where(Correction.run_id == run_id)
    if update is not None:  # a correction belongs to its step's update (ix_corrections_run_update)
        corr = corr.where(Correction.update_idx == update)
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
    """Every filter but the text, which ``search_steps`` and ``export_rows`` add per branch."""
    query = select(Step).where(Step.run_id == run.id)
    if f.update is not None:
        query = query.where(Step.update_idx == f.update)
    if f.verdict:
        query = query.where(_verdict(run.id, f.verdict, f.update))
    if f.format_valid is not None:
        query = query.where(Step.format_valid.is_(f.format_valid))
    if f.action:
        query = query.where(Step.parsed_action == f.action)
    if f.reward_min is not None:
        query = query.where(Step.reward >= f.reward_min)
    if f.reward_max is not None:
        query = query.where(Step.reward <= f.reward_max)
    return query


def _branches(session: Session, run: Run, f: StepFilter) -> list[Select]:
    base = search_query(session, run, f)
    q = (f.q or "").strip()
    return [base.where(c) for c in _text_branches(session, run.id, q)] if q else [base]


def _ids(session: Session, branches: list[Select], n: int, after: int = 0) -> list[int]:
    """The first ``n`` matching step ids (past ``after``) of the branches, merged in order."""
    ids: set[int] = set()
    for branch in branches:
        query = branch.with_only_columns(Step.id).where(Step.id > after).order_by(Step.id)
        ids.update(session.scalars(query.limit(n)))
    return sorted(ids)[:n]


def search_steps(
    session: Session, run: Run, f: StepFilter, limit: int, offset: int
) -> tuple[Sequence[Step], int, bool]:
    """A page of matching steps, the total, and whether counting stopped short of it.

    Filters count up to COUNT_CAP. A text search counts only through this page (a common word
    would otherwise be looked for in every thought of the run), and says whether more follow."""
    branches = _branches(session, run, f)
    text = bool((f.q or "").strip())
    cap = offset + limit if text else max(COUNT_CAP, offset + limit)
    ids = _ids(session, branches, cap + 1)
    page = ids[offset : offset + limit]
    rows = session.scalars(select(Step).where(Step.id.in_(page)).order_by(Step.id)).all()
    return rows, min(len(ids), cap), len(ids) > cap


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
    branches = _branches(session, run, f)
    last, sent = 0, 0
    while sent < EXPORT_CAP:
        ids = _ids(session, branches, min(1000, EXPORT_CAP - sent), after=last)
        rows = session.scalars(select(Step).where(Step.id.in_(ids)).order_by(Step.id)).all()
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
