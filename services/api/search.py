"""Step search: a run's steps filtered by verdict, format, action, reward, update and text.

Full text matches the steps whose thought, or whose corrected thought, holds every word of the
query, English-stemmed: on PostgreSQL through the GIN indexes over ``to_tsvector('english', …)``
(migration 0003), on SQLite (embedded) through the FTS5 tables with Porter stemming (migrations
0008, 0010). Both match the words of the JSON's values, never of its keys. Results come in
step-id order, a page at a time after (or before) a step id, so a deep page costs what the first
does. A search by filters counts its matches up to ``COUNT_CAP`` ("1,000+"); a text search
counts only through its page (a common word would be looked for in every thought of the run)
and says whether more follow.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from sqlalchemy import (
    Integer,
    and_,
    case,
    column,
    exists,
    func,
    literal_column,
    or_,
    select,
    table,
)
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql import Select

from shared.db.models import Correction, Run, Step

COUNT_CAP = 1_000
MAX_OFFSET = 10_000  # deeper pages: by the after/before cursors
EXPORT_CAP = 100_000  # rows of one export; narrow the search for more
TS_CONFIG = "english"
# The indexed expressions of migration 0003, character for character.
STEP_TSV = f"to_tsvector('{TS_CONFIG}', coalesce(steps.thought, ''))"
CORR_TSV = f"to_tsvector('{TS_CONFIG}', coalesce(corrections.corrected_thought, ''))"
# The FTS5 tables of migration 0010 (SQLite): a row's rowid is its step's / correction's id,
# its text the JSON's values (keys left out when indexed).
STEPS_FTS, CORRECTIONS_FTS = table("steps_fts", column("rowid")), table("corrections_fts")
WORD = re.compile(r"[^\W_]+")
# A stored thought is the output's JSON minus its action: its keys ("target number") are the
# task's format, not the agent's words. Both stores match the values only: SQLite's FTS5 tables
# index nothing else (migration 0010); on PostgreSQL the index finds the candidates, and this (a
# JSON string followed by ':' taken out) rechecks them.
JSON_KEY = r'"([^"\\]|\\.)*"[[:space:]]*:'

SPARSE = 8  # fewer than 1 step in SPARSE matching: a text search asks its index

Verdict = Literal["corrected", "correct", "failed", "pending", "none"]


class StepFilter(BaseModel):
    """What a step search asks for; every field optional (none: every step of the run)."""

    verdict: Verdict | None = Field(
        None,
        description="corrected: the corrector disagreed and corrected the thought (its "
        "correction records the verdict `incorrect`, also accepted here); correct: it agreed; "
        "failed: the correction failed; pending: not back yet; none: never sent (e.g. "
        "malformed output)",
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
        """A form sends its empty fields as '': they mean 'any'. The correction record's word
        for a corrected thought, `incorrect`, reads as the search's `corrected`."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and not v.strip())}
            if data.get("verdict") == "incorrect":
                data["verdict"] = "corrected"
        return data

    @field_validator("q", "action")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        """NUL, which PostgreSQL refuses in text, is stored as U+FFFD (models.FreeText)."""
        return v.replace("\x00", "\ufffd") if v else v

    def query_string(self) -> dict[str, str]:
        """The filters set, as URL query parameters (permalinks, pager, export links)."""
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in self.model_dump().items()
            if v is not None and v != ""
        }


@dataclass
class Hits:
    """One page of a search."""

    steps: Sequence[Step]
    total: int  # matches counted: up to COUNT_CAP (filters), through this page (text)
    capped: bool  # more match than ``total``
    next_after: int | None  # the ``after`` cursor of the next page; None on the last
    prev_before: int | None  # the ``before`` cursor of the previous page; None on the first


def fts5_query(q: str) -> str:
    """The words of ``q`` as an FTS5 query that matches rows holding all of them: each word a
    quoted string, so no user text reaches FTS5's operators (AND, NEAR, *, ^, column:). No word:
    an empty string, which matches nothing (as PostgreSQL's empty tsquery does)."""
    return " ".join(f'"{w}"' for w in WORD.findall(q)) or '""'


def _row_match(postgres: bool, q: str, corr: Any) -> Any:
    """Whether a step (outer-joined to its correction ``corr``) holds the words of ``q`` in its
    thought or corrected thought, tested row by row: PostgreSQL parses the two texts, SQLite
    looks the row up in its FTS5 tables."""
    if postgres:
        return or_(*(_values_match(t, q) for t in (Step.thought, corr.corrected_thought)))
    words, rowid = fts5_query(q), literal_column("rowid", Integer)
    in_correction = (
        exists()
        .select_from(CORRECTIONS_FTS)
        .where(literal_column("corrections_fts").match(words), rowid == corr.id)
    )
    return or_(
        exists().where(literal_column("steps_fts").match(words), STEPS_FTS.c.rowid == Step.id),
        # FTS5 reads every match of a word for "rowid = NULL": a step with no correction
        # must not ask (CASE, unlike AND, is sure to skip it).
        case((corr.id.is_(None), False), else_=in_correction),
    )


def _values_match(text: Any, q: str) -> Any:
    """PostgreSQL: the words of ``q`` are in the values of ``text``, not only in its JSON keys."""
    config: Any = literal_column(f"'{TS_CONFIG}'")
    values = func.regexp_replace(func.coalesce(text, ""), JSON_KEY, " ", "g")
    return func.to_tsvector(config, values).op("@@")(func.plainto_tsquery(config, q))


def _indexed(postgres: bool, run_id: int, q: str, after: int, before: int | None) -> list[Any]:
    """Conditions on Step: its thought holds the words of ``q``; its corrected thought does.
    Each the whole set of matches past the cursor from its text index, built before the steps
    are read (a rare word: the index lists its few steps at once)."""
    if postgres:
        # The expressions of migration 0003's indexes, constants inline (a bound parameter in
        # the expression would not match the index).
        tsq = func.plainto_tsquery(literal_column(f"'{TS_CONFIG}'"), q)
        step_id: Any = Step.id
        thought = select(Step.id).where(
            Step.run_id == run_id,
            literal_column(STEP_TSV).op("@@")(tsq),
            _values_match(Step.thought, q),
        )
        corr = and_(
            literal_column(CORR_TSV).op("@@")(tsq), _values_match(Correction.corrected_thought, q)
        )
    else:
        words = fts5_query(q)
        step_id = STEPS_FTS.c.rowid
        thought = select(step_id).where(literal_column("steps_fts").match(words))
        corr = Correction.id.in_(
            select(literal_column("rowid"))
            .select_from(CORRECTIONS_FTS)
            .where(literal_column("corrections_fts").match(words))
        )
    thought = thought.where(step_id > after)
    if before is not None:
        thought = thought.where(step_id < before)
    corrected = select(Correction.step_id).where(
        Correction.run_id == run_id, corr, *_range(Correction, after, before)
    )
    if not postgres:  # SQLite builds an IN list from its subquery, once
        return [Step.id.in_(thought), Step.id.in_(corrected)]
    # MATERIALIZED: planned on their own, so that the planner cannot trade the index for a scan
    # in id order that parses every thought to the end of the run.
    hits = [
        q.cte(f"hits_{i}").prefix_with("MATERIALIZED") for i, q in enumerate((thought, corrected))
    ]
    return [Step.id.in_(select(h.c[0])) for h in hits]


def _range(corr: Any, after: int, before: int | None) -> list[Any]:
    """The page's step-id range, stated on the corrections too: a join then starts at the
    cursor instead of at the run's first correction."""
    bounds = [corr.step_id > after]
    return bounds if before is None else [*bounds, corr.step_id < before]


VERDICTS: dict[str, list[Any]] = {
    "corrected": [Correction.verdict == "incorrect", Correction.status == "done"],
    "correct": [Correction.verdict == "correct", Correction.status == "done"],
    "failed": [Correction.status == "failed"],
    "pending": [Correction.status == "pending"],
}


def search_query(
    run: Run, f: StepFilter, after: int = 0, before: int | None = None
) -> tuple[Select, Any]:
    """The ids of the steps past ``after`` (and before ``before``) that pass every filter but
    the text, which ``_ids`` adds; and the column to order them by."""
    query, key = select(Step.id).where(Step.run_id == run.id, Step.id > after), Step.id
    if before is not None:
        query = query.where(Step.id < before)
    if f.update is not None:
        query = query.where(Step.update_idx == f.update)
    if f.verdict == "none":
        query = query.where(~exists().where(Correction.step_id == Step.id))
    elif f.verdict:
        # Joined and ordered by the correction's step id: both engines then walk
        # corrections(run_id, verdict | status, step_id) from the cursor and stop at the page.
        query = query.join(Correction, Correction.step_id == Step.id).where(
            Correction.run_id == run.id, *VERDICTS[f.verdict], *_range(Correction, after, before)
        )
        if f.update is not None:  # a correction belongs to its step's update
            query = query.where(Correction.update_idx == f.update)
        key = Correction.step_id
    if f.format_valid is not None:
        query = query.where(Step.format_valid.is_(f.format_valid))
    if f.action:
        query = query.where(Step.parsed_action == f.action)
    if f.reward_min is not None:
        query = query.where(Step.reward >= f.reward_min)
    if f.reward_max is not None:
        query = query.where(Step.reward <= f.reward_max)
    return query, key


def _ids(
    session: Session, run: Run, f: StepFilter, n: int, after: int = 0, before: int | None = None
) -> list[int]:
    """The first ``n`` matching step ids past ``after`` in ascending order, or with ``before``,
    the last ``n`` before it in descending order."""
    q = (f.q or "").strip()
    if q:
        return _text_ids(session, run, f, q, n, after, before)
    query, key = search_query(run, f, after, before)
    order = key.desc() if before is not None else key
    return list(dict.fromkeys(session.scalars(query.order_by(order).limit(n))))


def _text_ids(
    session: Session, run: Run, f: StepFilter, q: str, n: int, after: int, before: int | None
) -> list[int]:
    """A common word is found fastest by reading the steps in order and testing each; a rare one
    by its index, which lists all its steps at once (reading in order would test the whole run,
    and the planner cannot tell which is which for a word its statistics do not hold). So:
    read in order while at least one step in ``SPARSE`` matches, then ask the indexes."""
    postgres = session.get_bind().dialect.name == "postgresql"
    desc = before is not None
    hits: list[int] = []
    chunk = min(2 * n, 1024)
    while True:
        query, key = search_query(run, f, after, before)
        # A step has one correction (one corrector per run), so the outer join adds no rows.
        corr = aliased(Correction)
        probe = (
            query.add_columns(_row_match(postgres, q, corr))
            .outerjoin(corr, and_(corr.step_id == Step.id, *_range(corr, after, before)))
            .order_by(key.desc() if desc else key)
            .limit(chunk)
        )
        rows = session.execute(probe).all()
        found = list(dict.fromkeys(i for i, m in rows if m))
        hits += found
        if len(hits) >= n or len(rows) < chunk:  # enough, or the end of the run
            return hits[:n]
        after, before = (after, rows[-1][0]) if desc else (rows[-1][0], before)
        if len(found) * SPARSE < len(rows):
            break
        chunk = min(2 * chunk, 1024)
    query, key = search_query(run, f, after, before)
    ids = set(hits)
    for cond in _indexed(postgres, run.id, q, after, before):
        ordered = query.where(cond).order_by(key.desc() if desc else key)
        ids.update(session.scalars(ordered.limit(n - len(hits))))
    return sorted(ids, reverse=desc)[:n]


def _count(session: Session, run: Run, f: StepFilter) -> int:
    """Matches of a search by filters, counted up to COUNT_CAP + 1 in the database."""
    capped = search_query(run, f)[0].limit(COUNT_CAP + 1).subquery()
    return int(session.scalar(select(func.count()).select_from(capped)) or 0)


def search_steps(
    session: Session,
    run: Run,
    f: StepFilter,
    limit: int,
    offset: int = 0,
    after: int | None = None,
    before: int | None = None,
) -> Hits:
    """A page of matching steps: the first after ``after`` (skipping ``offset``), or the last
    before ``before``; with the total as counted and the cursors of its neighbours."""
    if before is not None:
        ids = _ids(session, run, f, limit + 1, before=before)
        page = sorted(ids[:limit])
        more_before, more_after = len(ids) > limit, True
    else:
        ids = _ids(session, run, f, offset + limit + 1, after=after or 0)
        page = ids[offset : offset + limit]
        more_before, more_after = bool(after or offset), len(ids) > offset + limit
    rows = session.scalars(select(Step).where(Step.id.in_(page)).order_by(Step.id)).all()
    if (f.q or "").strip():
        # What was found through this page: an offset past the end found no more than `ids`
        total, capped = min(len(ids), offset + len(page)), more_after
    else:
        total = _count(session, run, f)
        total, capped = min(total, COUNT_CAP), total > COUNT_CAP
    return Hits(
        rows,
        total,
        capped,
        next_after=page[-1] if page and more_after else None,
        prev_before=page[0] if page and more_before else None,
    )


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
    last, sent = 0, 0
    while sent < EXPORT_CAP:
        ids = _ids(session, run, f, min(1000, EXPORT_CAP - sent), after=last)
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


STOP_WORDS = frozenset({"the", "and", "that", "this", "with", "from", "have", "than", "then"})


def sample_word(session: Session, run: Run) -> str | None:
    """A word the run's agent really wrote (a value of its latest well-formed thought), for the
    search box's placeholder: keys ("target number") are never searched, so suggest a value."""
    import json

    thought = session.scalar(
        select(Step.thought)
        .where(Step.run_id == run.id, Step.format_valid.is_(True), Step.thought.is_not(None))
        .order_by(Step.id.desc())
        .limit(1)
    )
    try:
        data = json.loads(thought or "")
    except (json.JSONDecodeError, TypeError):
        return None
    values = data.values() if isinstance(data, dict) else []
    words = [
        w
        for v in values
        for w in WORD.findall(v if isinstance(v, str) else json.dumps(v))
        if len(w) >= 4 and w.isalpha() and w.lower() not in STOP_WORDS
    ]
    return max(words, key=len) if words else None
