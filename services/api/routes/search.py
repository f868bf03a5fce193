"""Step search and exports: REST (``/api/runs/{id}/steps``, ``…/steps/export``,
``…/updates/export``) and the search page of the web UI (``/runs/{id}/steps``)."""

from __future__ import annotations

import csv
import io
import json
import math
import unicodedata
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.orm import Session

from services.api import search, service
from services.api.auth import require_read
from services.api.deps import get_db
from services.api.routes.ui import PAGE_SIZE, User, not_found_page, render
from services.api.schemas import Page
from shared.db.models import ApiToken

router = APIRouter()
Db = Annotated[Session, Depends(get_db, scope="function")]
Reader = Annotated[ApiToken, Depends(require_read)]
RunId = Annotated[int, Path(ge=1, le=2**31 - 1)]
Filter = Annotated[search.StepFilter, Query()]
Format = Literal["csv", "json"]
# Keyset cursors: a page starts after (or ends before) a step id, at the same cost at any depth.
After = Annotated[
    int | None, Query(ge=0, le=2**63 - 1, description="Steps after this step id (a cursor)")
]
Before = Annotated[
    int | None, Query(ge=1, le=2**63 - 1, description="Steps before this step id (a cursor)")
]
# A download: CSV (format=csv) or JSON (format=json), documented for clients and schemathesis.
DOWNLOAD: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The rows as CSV (format=csv) or JSON (format=json)",
        "content": {"text/csv": {}, "application/json": {}},
    }
}


class StepHit(BaseModel):
    """One search result: enough to pick the step, whose page has the rest."""

    id: int
    episode_id: int
    update_idx: int
    idx: int
    parsed_action: str | None
    format_valid: bool
    reward: float
    verdict: str
    thought: str | None
    corrected_thought: str | None


class StepPage(Page[StepHit]):
    capped: bool = False  # more match than `total` (counting stopped at search.COUNT_CAP)
    next_after: int | None = None  # pass as `after` for the next page; None on the last
    prev_before: int | None = None  # pass as `before` for the previous page; None on the first


def _hits(db: Session, rows: Any) -> list[StepHit]:
    corr = search.verdicts(db, [s.id for s in rows])
    return [
        StepHit(
            id=s.id,
            episode_id=s.episode_id,
            update_idx=s.update_idx,
            idx=s.idx,
            parsed_action=s.parsed_action,
            format_valid=s.format_valid,
            reward=s.reward,
            verdict=search.verdict_of(corr.get(s.id)),
            thought=s.thought,
            corrected_thought=c.corrected_thought if (c := corr.get(s.id)) else None,
        )
        for s in rows
    ]


@router.get("/api/runs/{run_id}/steps", response_model=StepPage, tags=["runs"])
def search_steps(
    run_id: RunId,
    db: Db,
    token: Reader,
    f: Filter,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=search.MAX_OFFSET)] = 0,
    after: After = None,
    before: Before = None,
) -> StepPage:
    """Steps of a run by verdict, format, action, reward, update and words of the thoughts,
    in step order; page on with `after=next_after` (or back with `before=prev_before`)."""
    run = service.get_run(db, token, run_id)
    hits = search.search_steps(db, run, f, limit, offset, after, before)
    return StepPage(
        items=_hits(db, hits.steps),
        total=hits.total,
        limit=limit,
        offset=offset,
        capped=hits.capped,
        next_after=hits.next_after,
        prev_before=hits.prev_before,
    )


@router.get("/api/runs/{run_id}/steps/export", tags=["runs"], responses=DOWNLOAD)
def export_steps(
    run_id: RunId, db: Db, token: Reader, f: Filter, format: Format = "csv"
) -> Response:
    """Every step a search finds (up to 100,000) as CSV or JSON, for a notebook."""
    run = service.get_run(db, token, run_id)
    # Read here: the request's session is closed before a streamed body is sent.
    rows = list(search.export_rows(db, run, f))
    return _download(iter(rows), search.EXPORT_COLUMNS, format, f"run-{run.id}-steps")


@router.get("/api/runs/{run_id}/updates/export", tags=["runs"], responses=DOWNLOAD)
def export_updates(run_id: RunId, db: Db, token: Reader, format: Format = "csv") -> Response:
    """Every update's metrics as CSV (one column per metric) or JSON."""
    run = service.get_run(db, token, run_id)
    updates, _ = service.list_updates(db, run, 1_000_000, 0)
    records = [
        {"update": u.idx, "created_at": u.created_at.isoformat(), "alarm": u.alarm, **u.metrics}
        for u in updates
    ]
    columns = list(dict.fromkeys(k for r in records for k in r)) or ["update"]
    return _download(iter(records), columns, format, f"run-{run.id}-metrics")


def _download(rows: Iterator[dict], columns: Iterable[str], fmt: str, name: str) -> Response:
    headers = {"Content-Disposition": f'attachment; filename="{name}.{fmt}"'}
    if fmt == "json":
        body = (json.dumps(_finite(r)) for r in rows)
        return StreamingResponse(_json_array(body), media_type="application/json", headers=headers)
    return StreamingResponse(_csv(rows, list(columns)), media_type="text/csv", headers=headers)


def _finite(record: dict) -> dict:
    """JSON has no NaN: a non-finite metric is written as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


def _json_array(items: Iterator[str]) -> Iterator[str]:
    yield "["
    for i, item in enumerate(items):
        yield ("," if i else "") + item
    yield "]"


def _csv(rows: Iterator[dict], columns: list[str]) -> Iterator[str]:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, extrasaction="ignore")
    csv.writer(buf).writerow([_cell(c) for c in columns])  # a metric's name is text too
    for i, row in enumerate(rows):
        writer.writerow({k: _cell(v) for k, v in row.items()})
        if i % 500 == 499:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


FORMULA_START = ("=", "+", "-", "@")


def _hidden(c: str) -> bool:
    """A blank or invisible character: spaces of every width (no-break, U+3000), line and page
    breaks (VT, FF), controls and format characters (zero-width space, bidi marks)."""
    return c.isspace() or unicodedata.category(c) in ("Cc", "Cf", "Zs", "Zl", "Zp")


def _cell(v: Any) -> Any:
    """A spreadsheet runs a cell that starts with = + - @ as a formula (full-width ＝ too), and
    may drop what precedes it: a cell starting with any blank or invisible character is quoted
    like one starting with =."""
    lead = unicodedata.normalize("NFKC", v[:1]) if isinstance(v, str) else ""
    if isinstance(v, str) and len(v) > 1 and (lead in FORMULA_START or _hidden(v[0])):
        return "'" + v
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return v


# ---- the web UI's search page -----------------------------------------------------------


VERDICT_NAMES = ("corrected", "correct", "failed", "pending", "none")


class _Cursors(BaseModel):
    after: int | None = Field(None, ge=0, le=2**63 - 1)
    before: int | None = Field(None, ge=1, le=2**63 - 1)


def form_errors(e: ValidationError) -> list[str]:
    """A form's bad values, named as its fields are (the input itself is not echoed)."""
    return [f"{'.'.join(map(str, err['loc'])) or 'query'}: {err['msg']}" for err in e.errors()]


def read_form(params: dict[str, str]) -> tuple[search.StepFilter, _Cursors, list[str]]:
    """The search form from the URL; a bad value is left out of the search and named."""
    errors: list[str] = []
    try:
        cursors = _Cursors.model_validate(params)
    except ValidationError as e:
        cursors, errors = _Cursors(), form_errors(e)
    try:
        return search.StepFilter.model_validate(params), cursors, errors
    except ValidationError as e:
        bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        good = {k: v for k, v in params.items() if k not in bad}
        try:
            f = search.StepFilter.model_validate(good)
        except ValidationError:
            f = search.StepFilter()
        return f, cursors, errors + form_errors(e)


@router.get("/runs/{run_id}/steps", include_in_schema=False)
def steps_page(request: Request, run_id: RunId, db: Db, me: User) -> HTMLResponse:
    """Search a run's steps; every result opens its step page; the URL is the permalink. A bad
    value answers this page with the form's error (422), not the API's JSON."""
    try:
        run = service.get_run(db, me, run_id)
    except service.NotFound:
        return not_found_page(request, me, f"run {run_id}")
    f, cursors, errors = read_form(dict(request.query_params))
    word = search.sample_word(db, run)
    placeholder = f"e.g. {word} (words the agent wrote)" if word else "words the agent wrote"
    query = urlencode(f.query_string())
    base = f"/runs/{run.id}/steps?" + (query + "&" if query else "")
    if errors:  # the form, its errors and no results: a search on half the form would mislead
        return render(
            request, "steps.html", me, 422, run=run, f=f, errors=errors, hits=[],
            verdicts=VERDICT_NAMES, total=0, capped=False, text=False, pages={}, query=query,
            placeholder=placeholder,
        )  # fmt: skip
    hits = search.search_steps(db, run, f, PAGE_SIZE, after=cursors.after, before=cursors.before)
    return render(
        request,
        "steps.html",
        me,
        run=run,
        f=f,
        hits=_hits(db, hits.steps),
        verdicts=VERDICT_NAMES,
        total=hits.total,
        capped=hits.capped,
        text=bool((f.q or "").strip()),
        pages={
            "first": base.rstrip("?&") if hits.prev_before is not None else None,
            "earlier": None if hits.prev_before is None else f"{base}before={hits.prev_before}",
            "later": None if hits.next_after is None else f"{base}after={hits.next_after}",
        },
        query=query,
        placeholder=placeholder,
    )
