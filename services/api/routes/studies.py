"""Studies: a grid of runs launched as one, judged by its declared primary metric."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from services.api import service as runs
from services.api.auth import require_read, require_write
from services.api.deps import get_db
from services.api.launch import check_launch
from services.api.schemas import Page
from services.study import service
from services.study.report import StudyReport, build_report
from services.study.schemas import StudyConfig
from shared.db.models import ApiToken, Study

router = APIRouter(prefix="/api", tags=["studies"])

Db = Annotated[Session, Depends(get_db, scope="function")]
Reader = Annotated[ApiToken, Depends(require_read)]
Writer = Annotated[ApiToken, Depends(require_write)]
StudyId = Annotated[int, Path(ge=1, le=2**31 - 1)]


class StudyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    team: str
    status: str  # queued | running | done | failed | cancelled
    primary_metric: str
    concurrency: int
    created_at: datetime
    updated_at: datetime
    counts: dict[str, int] = {}  # cells, waiting, queued, running, done, failed, cancelled


def study_out(db: Session, study: Study) -> StudyOut:
    out = StudyOut.model_validate(study)
    out.counts = service.plan(db, study).counts()
    return out


def _get(db: Session, token: ApiToken, study_id: int) -> Study:
    try:
        return service.get_study(db, token, study_id)
    except service.StudyNotFound as e:
        raise runs.NotFound(str(e)) from None


def _check_cells(db: Session, cfg: StudyConfig, team: str) -> None:
    """Each distinct run config passes the checks a single run meets at launch (its corrector,
    model and checkpoint must be the team's); a refusal names the task and arm."""
    seen: set[str] = set()
    for cell in cfg.cells():
        run_cfg = cfg.run_config(cell)
        key = run_cfg.model_dump_json(exclude={"name", "seed"})
        if key in seen:
            continue
        seen.add(key)
        try:
            runs.check_corrector(db, run_cfg, team)
            check_launch(db, run_cfg, team)
        except runs.Invalid as e:
            loc = ("arms", cell.arm, *e.loc)
            raise runs.Invalid(loc, f"{cell.describe()}: {e.msg}") from None


@router.post("/studies", response_model=StudyOut, status_code=201)
def create_study(config: StudyConfig, db: Db, token: Writer) -> StudyOut:
    """Launch a study; its runs are queued for the controllers, `concurrency` at a time."""
    _check_cells(db, config, token.team)
    study = service.create_study(db, config, token.team)
    service.advance(db, study)
    db.commit()
    return study_out(db, study)


@router.get("/studies", response_model=Page[StudyOut])
def list_studies(
    db: Db,
    token: Reader,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> Page[StudyOut]:
    """Studies of the token's team, newest first."""
    rows, total = service.list_studies(db, token, limit, offset)
    return Page(items=[study_out(db, s) for s in rows], total=total, limit=limit, offset=offset)


@router.get("/studies/{study_id}", response_model=StudyReport)
def get_study(study_id: StudyId, db: Db, token: Reader) -> StudyReport:
    """The study's report: progress, per-arm intervals, paired comparisons and verdicts."""
    study = _get(db, token, study_id)
    return build_report(db, study.id)


@router.put("/studies/{study_id}", response_model=StudyOut)
def replace_study(study_id: StudyId, config: StudyConfig, db: Db, token: Writer) -> StudyOut:
    """Replace the study file (e.g. more seeds); its primary metric is frozen once runs exist."""
    study = _get(db, token, study_id)
    _check_cells(db, config, token.team)
    try:
        service.replace_spec(db, study, config)
    except service.StudyRefused as e:
        raise runs.Conflict(str(e)) from None
    if study.status in ("done", "failed"):
        study.status = "queued"  # new cells run; advance says done again otherwise
    service.advance(db, study)
    db.commit()
    return study_out(db, study)


@router.post("/studies/{study_id}/cancel", response_model=StudyOut)
def cancel_study(study_id: StudyId, db: Db, token: Writer) -> StudyOut:
    """Stop the study: queued runs are cancelled, running ones stopped by their controller."""
    study = _get(db, token, study_id)
    try:
        service.cancel_study(db, study)
    except service.StudyConflict as e:
        raise runs.Conflict(str(e)) from None
    db.commit()
    return study_out(db, study)


@router.post("/studies/{study_id}/resume", response_model=StudyOut)
def resume_study(study_id: StudyId, db: Db, token: Writer) -> StudyOut:
    """Continue a cancelled study; a finished run is never rerun."""
    study = _get(db, token, study_id)
    # An imported study's file and runs were never launched here: they pass the launch checks
    # now, as the study's team, before anything is queued.
    _check_cells(db, service.config_of(study), study.team)
    for run in service.plan(db, study).cancelled:
        runs.recheck(db, run.config, study.team)
    try:
        service.resume_study(db, study)
    except service.StudyConflict as e:
        raise runs.Conflict(str(e)) from None
    service.advance(db, study)
    db.commit()
    return study_out(db, study)
