"""The study pages of the web UI: the team's studies, and one study's report (progress, curves
with bands, the primary-metric table with intervals and verdicts, paired comparisons, every
other figure labelled secondary), with its CSV and JSON export."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.api.routes.search import _csv
from services.api.routes.ui import PAGE_SIZE, Db, User, not_found_page, render
from services.study import service
from services.study.outputs import ComparisonOut
from services.study.report import MetricBlock, StudyReport, build_report
from shared.db.models import ApiToken, Run, Study, Update
from shared.settings import get_settings

router = APIRouter(include_in_schema=False)
StudyId = Annotated[int, Path(ge=1, le=2**31 - 1)]
CSV_COLUMNS = [
    "task",
    "variant",
    "metric",
    "role",
    "kind",
    "arm",
    "versus",
    "seed",
    "run_id",
    "value",
    "low",
    "high",
    "n",
    "p_value",
    "verdict",
    "seeds_for_power",
]


# Built reports, by study and a fingerprint of what they are built from: the study's row and
# spec, each of its runs' status and progress, and its newest update row. A finished study's
# page is then one cheap query away from its report (building the v3 study's takes seconds of
# bootstrap); a live study's is rebuilt when that changes, and at least every LIVE_TTL_S (a
# late correction rewrites an update's figures in place).
_CACHE: OrderedDict[int, tuple[tuple[Any, ...], float, StudyReport]] = OrderedDict()
CACHE_SIZE = 8
LIVE_TTL_S = 15.0
STUDY_CODE = FsPath(__file__).resolve().parents[2] / "study"


def _fingerprint(db: Session, study: Study) -> tuple[Any, ...]:
    runs = db.execute(
        select(Run.id, Run.status, Run.updates_done, Run.study_attempt).where(
            Run.study_id == study.id
        )
    ).all()
    newest = db.scalar(
        select(func.max(Update.id))
        .join(Run, Run.id == Update.run_id)
        .where(Run.study_id == study.id)
    )
    spec = json.dumps(study.spec, sort_keys=True, default=str)
    return (study.status, study.updated_at, spec, tuple(sorted(tuple(r) for r in runs)), newest)


@functools.cache
def _code_version() -> str:
    """The report's code, so that a kept report is never one an older code built."""
    digest = hashlib.sha256()
    for path in sorted(STUDY_CODE.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _kept_file(db: Session, study_id: int, key: tuple[Any, ...]) -> FsPath:
    """Where a finished study's report is kept between server starts (and shared by a server's
    workers): the data folder, by database, study, fingerprint and code."""
    bind = db.get_bind()
    url = str(bind.engine.url)
    name = hashlib.sha256(repr((url, key, _code_version())).encode()).hexdigest()[:24]
    return get_settings().data_dir / "cache" / "study-reports" / f"{study_id}-{name}.json"


def _kept(db: Session, study_id: int, key: tuple[Any, ...], live: bool) -> StudyReport | None:
    if live:
        return None
    try:
        return StudyReport.model_validate_json(_kept_file(db, study_id, key).read_bytes())
    except (OSError, ValueError):
        return None


def _keep(db: Session, study_id: int, key: tuple[Any, ...], report: StudyReport) -> None:
    path = _kept_file(db, study_id, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{study_id}-*.json"):
            old.unlink(missing_ok=True)  # the study's earlier reports
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(report.model_dump_json())
        tmp.replace(path)
    except OSError:
        pass  # a read-only data folder: the report is kept in memory only


def _report(db: Db, me: ApiToken, study_id: int) -> StudyReport | None:
    try:  # the team's (an admin token sees every team's)
        study = service.get_study(db, me, study_id)
    except service.StudyNotFound:
        return None
    key, now = _fingerprint(db, study), time.monotonic()
    hit = _CACHE.get(study_id)
    live = study.status in service.ACTIVE
    if hit is not None and hit[0] == key and not (live and now - hit[1] > LIVE_TTL_S):
        _CACHE.move_to_end(study_id)
        return hit[2]
    report = _kept(db, study_id, key, live)
    if report is None:
        report = build_report(db, study_id)
        if not live:
            _keep(db, study_id, key, report)
    _CACHE[study_id] = (key, now, report)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return report


def undecided_why(c: ComparisonOut, alpha: float) -> str:
    """Why a comparison reads "not decided", in words: no shared seed, tied seeds, too few
    seeds for any p under alpha, seeds that disagree, or an interval that holds 0."""
    n = len(c.seeds)
    if c.winner is not None or not c.verdict.startswith("not decided"):
        return ""  # decided, or refused with its reason in the verdict itself
    if n == 0:
        return "no seed that both arms finished"
    ties = sum(1 for d in c.diffs if d == 0)
    if ties == n:
        return f"tied at every seed ({c.a} − {c.b} = 0 at each of {n})"
    tied = f"{ties} of {n} seeds tied (difference 0); " if ties else ""
    untied = n - ties
    smallest = 2 / 2**untied
    if smallest >= alpha:
        return (
            f"{tied}with {untied} untied seed{'s' if untied != 1 else ''} the smallest possible "
            f"p is {smallest:.3g}, not under α = {alpha:g}: more seeds are needed"
        )
    better = sum(1 for d in c.diffs if d > 0)
    worse = untied - better
    if c.p_holm is not None and c.p_value is not None and c.p_value < alpha <= c.p_holm:
        return (
            f"{tied}p = {c.p_value:.3g} is under α = {alpha:g}, but not after Holm's adjustment "
            f"over the task's confirmatory comparisons (p = {c.p_holm:.3g})"
        )
    if c.p_value is not None and c.p_value >= alpha:
        return (
            f"{tied}the seeds disagree: {c.a} ahead at {better}, {c.b} at {worse} "
            f"(p = {c.p_value:.3g} ≥ α = {alpha:g})"
        )
    iv = c.mean_diff
    if iv.low is not None and iv.high is not None:
        return f"{tied}the 95 % interval of {c.a} − {c.b}, [{iv.low:.3f}, {iv.high:.3f}], holds 0"
    return f"{tied}no interval over the seeds"


def shown_comparisons(block: MetricBlock) -> list[ComparisonOut]:
    """The comparisons worth a row: not those with an arm that records no value of the metric
    (RL4VLM has no corrector accuracy), which could only read "not decided at 0 seeds"."""
    valued = {a.arm for a in block.arms if a.scores}
    return [c for c in block.comparisons if c.seeds or (c.a in valued and c.b in valued)]


def unvalued_arms(block: MetricBlock) -> list[str]:
    """Arms with finished runs that record no value of this metric."""
    return [a.arm for a in block.arms if not a.scores]


@router.get("/studies")
def studies_page(
    request: Request, db: Db, me: User, page: Annotated[int, Query(ge=1, le=1_000_000)] = 1
) -> HTMLResponse:
    """The team's studies, newest first."""
    rows, total = service.list_studies(db, me, PAGE_SIZE, (page - 1) * PAGE_SIZE)
    last = max(1, math.ceil(total / PAGE_SIZE))
    studies = [(s, service.plan(db, s).counts()) for s in rows]
    return render(
        request,
        "studies.html",
        me,
        studies=studies,
        pager={"page": min(page, last), "last": last, "total": total},
    )


@router.get("/studies/{study_id}")
def study_page(request: Request, study_id: StudyId, db: Db, me: User) -> HTMLResponse:
    """One study: progress, curves per arm with bands, verdicts, paired comparisons."""
    report = _report(db, me, study_id)
    if report is None:
        return not_found_page(request, me, f"study {study_id}")
    return render(
        request,
        "study.html",
        me,
        report=report,
        arm_runs=_arm_runs,
        compare_url=_compare_url,
        why=undecided_why,
        shown=shown_comparisons,
        unvalued=unvalued_arms,
    )


@router.get("/studies/{study_id}/curves.json")
def study_curves(study_id: StudyId, db: Db, me: User) -> Response:
    """The study page's learning curves (mean and band per arm and metric), fetched by the
    page's script after the tables: the page itself stays small."""
    report = _report(db, me, study_id)
    if report is None:
        return JSONResponse({"detail": f"study {study_id} not found"}, 404)
    return JSONResponse(
        [
            {
                "id": f"g{i}",
                "metrics": [
                    {"metric": b.metric, "label": b.label, "role": b.role}
                    for b in [g.primary, *g.secondary]
                ],
                "curves": [
                    {
                        "arm": c.arm,
                        "metric": c.metric,
                        "points": [
                            {
                                "update": p.update,
                                "mean": round(p.mean, 4),
                                "low": None if p.low is None else round(p.low, 4),
                                "high": None if p.high is None else round(p.high, 4),
                            }
                            for p in c.points
                        ],
                    }
                    for c in g.curves
                ],
                "arms": g.arms,
            }
            for i, g in enumerate(report.groups)
        ]
    )


def _compare_url(run_ids: list[int]) -> str:
    """The compare page of exactly these runs (every one: its title counts them)."""
    return "/compare?" + "&".join(f"runs={r}" for r in run_ids)


def _arm_runs(block: MetricBlock, arm: str) -> str:
    """The compare page of an arm's scored runs."""
    runs = next((a.runs for a in block.arms if a.arm == arm), {})
    return _compare_url([r for _, r in sorted(runs.items())])


@router.get("/studies/{study_id}/report.json")
def study_json(study_id: StudyId, db: Db, me: User) -> Response:
    """The whole report as JSON (as GET /api/studies/{id} returns it), as a download."""
    report = _report(db, me, study_id)
    if report is None:
        return Response(json.dumps({"detail": f"study {study_id} not found"}), 404)
    return Response(
        report.model_dump_json(indent=1),
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="study-{study_id}.json"'},
    )


@router.get("/studies/{study_id}/report.csv")
def study_csv(study_id: StudyId, db: Db, me: User) -> Response:
    """One row per run score, per arm summary and per comparison, every metric (tidy CSV)."""
    report = _report(db, me, study_id)
    if report is None:
        return Response(f"study {study_id} not found\n", 404, media_type="text/plain")
    return StreamingResponse(
        _csv(_csv_rows(report), CSV_COLUMNS),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="study-{study_id}.csv"'},
    )


def _csv_rows(report: StudyReport) -> Iterator[dict[str, Any]]:
    for g in report.groups:
        for block in [g.primary, *g.secondary]:
            head = {"task": g.task, "variant": g.variant, "metric": block.metric}
            head["role"] = block.role
            for a in block.arms:
                for seed, score in sorted(a.scores.items()):
                    run = a.runs.get(seed)
                    yield {**head, "kind": "run", "arm": a.arm, "seed": seed, "run_id": run,
                           "value": score}  # fmt: skip
                iv = a.mean
                yield {**head, "kind": "arm mean", "arm": a.arm, "value": iv.point,
                       "low": iv.low, "high": iv.high, "n": iv.n}  # fmt: skip
            for c in block.comparisons:
                iv = c.mean_diff
                yield {**head, "kind": "paired difference", "arm": c.a, "versus": c.b,
                       "value": iv.point, "low": iv.low, "high": iv.high, "n": iv.n,
                       "p_value": c.p_value, "verdict": c.verdict,
                       "seeds_for_power": c.seeds_for_power}  # fmt: skip
