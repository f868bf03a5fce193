"""The runs list of the web UI: by recent activity (running runs first), filtered by status,
study and name, with a study's runs folded into one row (its own page lists them).

A run's activity is its latest of finished, started and created; a study row's, its runs'
latest. Sorting and paging happen over light (id, status, times) rows, so only the page's runs
are loaded in full."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.api.service import visible_runs
from shared.db.models import ApiToken, Run, Study

NO_STUDY = "none"  # the study filter's value for runs outside any study
MAX_LISTED = 20_000  # runs sorted in one listing (a team's runs; narrow with the filters)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class StudyRow:
    """A study's runs, folded: how many in each status, and the latest activity."""

    study_id: int
    name: str
    counts: dict[str, int] = field(default_factory=dict)
    activity: datetime = EPOCH

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def running(self) -> bool:
        return self.counts.get("running", 0) > 0


@dataclass
class Listing:
    rows: list[Any]  # Run or StudyRow, in the page's order
    total: int
    studies: list[tuple[int, str]]  # the team's studies with runs, for the filter


def _aware(t: datetime | None) -> datetime:
    if t is None:
        return EPOCH
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _key(running: bool, queued: bool, activity: datetime) -> tuple[int, float]:
    return (0 if running else 1 if queued else 2, -activity.timestamp())


def list_runs(
    db: Session,
    token: ApiToken,
    status: str | None,
    study: str | None,
    name: str | None,
    limit: int,
    offset: int,
) -> Listing:
    """One page of the runs list. ``study`` is a study id, NO_STUDY, or None (every run, each
    study's folded into one row unless ``name`` asks for runs by name)."""
    base = visible_runs(token).subquery()
    query = select(
        base.c.id,
        base.c.status,
        base.c.study_id,
        func.coalesce(base.c.finished_at, base.c.started_at, base.c.created_at),
    )
    if status:
        query = query.where(base.c.status == status)
    if name:
        query = query.where(base.c.name.ilike(f"%{_like(name)}%", escape="\\"))
    if study == NO_STUDY:
        query = query.where(base.c.study_id.is_(None))
    elif study is not None:
        query = query.where(base.c.study_id == int(study))
    light = db.execute(query.order_by(base.c.id.desc()).limit(MAX_LISTED)).all()
    fold = study is None and not name
    items: list[tuple[tuple[int, float], Any]] = []
    folded: dict[int, StudyRow] = {}
    for run_id, state, study_id, at in light:
        if fold and study_id is not None:
            row = folded.setdefault(study_id, StudyRow(study_id, ""))
            row.counts[state] = row.counts.get(state, 0) + 1
            row.activity = max(row.activity, _aware(at))
            continue
        items.append((_key(state == "running", state == "queued", _aware(at)), run_id))
    for row in folded.values():
        queued = row.counts.get("queued", 0) > 0
        items.append((_key(row.running, queued, row.activity), row))
    items.sort(key=lambda kv: (kv[0], -(kv[1] if isinstance(kv[1], int) else kv[1].study_id)))
    page = [item for _, item in items[offset : offset + limit]]
    ids = [p for p in page if isinstance(p, int)]
    runs = {r.id: r for r in db.scalars(select(Run).where(Run.id.in_(ids)))} if ids else {}
    names = dict(db.execute(select(Study.id, Study.name).where(Study.id.in_(folded))).all())
    for row in folded.values():
        row.name = names.get(row.study_id, f"study {row.study_id}")
    team_studies = db.execute(
        select(Study.id, Study.name)
        .where(Study.id.in_(select(base.c.study_id).where(base.c.study_id.is_not(None))))
        .order_by(Study.id.desc())
    ).all()
    rows = [runs.get(p) if isinstance(p, int) else p for p in page]
    return Listing(
        rows=[r for r in rows if r is not None],
        total=len(items),
        studies=[(i, n) for i, n in team_studies],
    )


def _like(text: str) -> str:
    """A name filter matches its text literally (no wildcards of its own)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
