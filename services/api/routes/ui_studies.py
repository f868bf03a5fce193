"""The study pages of the web UI: the team's studies, and one study's report (progress, curves
with bands, the primary-metric table with intervals and verdicts, paired comparisons, every
other figure labelled secondary), with its CSV and JSON export."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from services.api.routes.search import _csv
from services.api.routes.ui import PAGE_SIZE, Db, User, not_found_page, render
from services.study import kept, service
from services.study.console import need_text, power_text, undecided_why
from services.study.outputs import ComparisonOut
from services.study.report import Curve, MetricBlock, StudyReport
from shared.db.models import ApiToken

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


def _report(db: Db, me: ApiToken, study_id: int) -> StudyReport | None:
    try:  # the team's (an admin token sees every team's)
        study = service.get_study(db, me, study_id)
    except service.StudyNotFound:
        return None
    return kept.report_of(db, study)


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
        need=need_text,
        power=power_text,
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
                "curves": [_curve_json(c) for c in g.curves],
                "change_curves": [_curve_json(c) for c in g.change_curves],
                "arms": g.arms,
            }
            for i, g in enumerate(report.groups)
        ]
    )


def _curve_json(c: Curve) -> dict[str, Any]:
    return {
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
    """One row per run score, per seed's start, per arm summary and per comparison, every
    metric (tidy CSV)."""
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
            for seed, start in sorted(block.start_scores.items()):  # before update 0, shared
                yield {**head, "kind": "start", "seed": seed, "value": start}
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
