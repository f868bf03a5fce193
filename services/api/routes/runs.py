"""Runs and everything recorded under them: updates, episodes, steps, corrections, checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Response
from sqlalchemy.orm import Session

from services.api import display, service
from services.api.auth import require_read, require_write
from services.api.deps import get_db
from services.api.launch import check_launch
from services.api.schemas import (
    CheckpointOut,
    CorrectionOut,
    CorrectorCost,
    EpisodeOut,
    Page,
    RunOut,
    StepDetail,
    StepOut,
    TokenOut,
    UpdateOut,
)
from shared.db.models import ApiToken, Run
from shared.schemas import RunConfig
from shared.storage import blob_store, check_sha

router = APIRouter(prefix="/api", tags=["runs"])

# scope="function": the session commits before the response is sent, not after.
Db = Annotated[Session, Depends(get_db, scope="function")]
Reader = Annotated[ApiToken, Depends(require_read)]
Writer = Annotated[ApiToken, Depends(require_write)]
# Documented for clients and schemathesis; check_sha answers anything else with a 400.
BlobId = Annotated[str, Path(json_schema_extra={"pattern": "^[0-9a-f]{64}$"})]
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
Id = Annotated[int, Path(ge=1, le=2**63 - 1)]
RunId = Annotated[int, Path(ge=1, le=2**31 - 1)]
Status = Literal["queued", "running", "completed", "degraded", "failed", "cancelled", "superseded"]


def run_out(db: Session, run: Run) -> RunOut:
    out = RunOut.model_validate(run)
    out.latest_metrics = service.latest_metrics(db, run.id)
    timing = service.run_timing(db, run)
    out.elapsed_s, out.eta_s, out.eta_of = timing["elapsed_s"], timing["eta_s"], timing["eta_of"]
    out.eta_over_s = timing["eta_over_s"]
    if service.sends_to_corrector(run):
        out.corrector_cost = CorrectorCost(**service.corrector_cost(db, run.id))
    return out


@router.get("/me", response_model=TokenOut)
def me(token: Reader) -> ApiToken:
    """The token making the request: its name, scope and team."""
    return token


@router.post("/runs", response_model=RunOut, status_code=201)
def create_run(config: RunConfig, db: Db, token: Writer) -> RunOut:
    """Launch a run from a run config; a controller picks it up."""
    config = check_launch(db, config, token.team)  # corrector, model, checkpoint: the team's
    run = service.create_run(db, config, token.team)
    db.commit()
    return run_out(db, run)


@router.get("/runs", response_model=Page[RunOut])
def list_runs(
    db: Db, token: Reader, status: Status | None = None, limit: Limit = 50, offset: Offset = 0
) -> Page[RunOut]:
    """Runs of the token's team, newest first."""
    rows, total = service.list_runs(db, token, status, limit, offset)
    return Page(items=[run_out(db, r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/runs/{run_id}", response_model=RunOut)
def get_run(run_id: RunId, db: Db, token: Reader) -> RunOut:
    """One run, with its latest metrics."""
    return run_out(db, service.get_run(db, token, run_id))


@router.post("/runs/{run_id}/cancel", response_model=RunOut)
def cancel_run(run_id: RunId, db: Db, token: Writer) -> RunOut:
    """Ask the run to stop; it ends 'cancelled'."""
    run = service.cancel_run(db, token, run_id)
    db.commit()
    return run_out(db, run)


@router.post("/runs/{run_id}/resume", response_model=RunOut)
def resume_run(run_id: RunId, db: Db, token: Writer) -> RunOut:
    """Queue a failed run again; it resumes after its last trained update."""
    run = service.resume_run(db, token, run_id)
    db.commit()
    return run_out(db, run)


@router.get("/runs/{run_id}/updates", response_model=Page[UpdateOut])
def list_updates(
    run_id: RunId, db: Db, token: Reader, limit: Limit = 500, offset: Offset = 0
) -> Page[UpdateOut]:
    """Per-update metrics: success, losses, thought-collapse monitors."""
    rows, total = service.list_updates(db, service.get_run(db, token, run_id), limit, offset)
    return Page(
        items=[UpdateOut.model_validate(r) for r in rows], total=total, limit=limit, offset=offset
    )


@router.get("/runs/{run_id}/episodes", response_model=Page[EpisodeOut])
def list_episodes(
    run_id: RunId,
    db: Db,
    token: Reader,
    update: Annotated[int | None, Query(ge=0)] = None,
    success: bool | None = None,
    corrected: bool | None = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[EpisodeOut]:
    """Episodes, filtered by update, success, and whether any step was corrected."""
    run = service.get_run(db, token, run_id)
    rows, total = service.list_episodes(db, run, update, success, corrected, limit, offset)
    return Page(
        items=[EpisodeOut.model_validate(r) for r in rows], total=total, limit=limit, offset=offset
    )


@router.get("/episodes/{episode_id}/steps", response_model=Page[StepOut])
def list_steps(episode_id: RunId, db: Db, token: Reader) -> Page[StepOut]:
    """Every step of an episode with its corrections."""
    rows = service.list_steps(db, service.get_episode(db, token, episode_id))
    items = [_step_out(StepOut, s, c) for s, c in rows]
    return Page(items=items, total=len(items), limit=len(items), offset=0)


@router.get("/steps/{step_id}", response_model=StepDetail)
def get_step(step_id: Id, db: Db, token: Reader) -> StepDetail:
    """One step, its corrections, and its neighbours for navigation."""
    step, corrections, nav = service.get_step(db, token, step_id)
    out = _step_out(StepDetail, step, corrections)
    return out.model_copy(update=nav)


@router.get(
    "/steps/{step_id}/display",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}}, 304: {"description": "Not modified"}},
)
def get_step_display(
    step_id: Id,
    db: Db,
    token: Reader,
    if_none_match: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """A step's frame for people (PNG): drawn from its recorded state when first viewed."""
    step, run = display.visible_step(db, token, step_id)
    etag = f'"{step.display_sha}"' if step.display_sha else None
    if etag is not None and if_none_match == etag:
        return Response(status_code=304, headers={"ETag": etag})
    png = display.display_png(db, blob_store(), step, run)
    if png is None:
        raise service.NotFound(f"step {step_id} has no frame")
    # Revalidated by ETag, not cached by URL: a resumed SQLite run may reuse a discarded id.
    headers = {"Cache-Control": "private, no-cache"}
    if step.display_sha:
        headers["ETag"] = f'"{step.display_sha}"'
    return Response(png, media_type="image/png", headers=headers)


@router.get("/runs/{run_id}/corrections", response_model=Page[CorrectionOut])
def list_corrections(
    run_id: RunId,
    db: Db,
    token: Reader,
    status: Literal["pending", "done", "failed"] | None = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[CorrectionOut]:
    """Corrections of a run, filtered by status."""
    rows, total = service.list_corrections(
        db, service.get_run(db, token, run_id), status, limit, offset
    )
    return Page(
        items=[CorrectionOut.model_validate(r) for r in rows],
        total=total,
        limit=limit,
        offset=offset,
    )


@router.get("/runs/{run_id}/checkpoints", response_model=Page[CheckpointOut])
def list_checkpoints(run_id: RunId, db: Db, token: Reader) -> Page[CheckpointOut]:
    """The run's checkpoint chain."""
    rows = service.list_checkpoints(db, service.get_run(db, token, run_id))
    return Page(
        items=[CheckpointOut.model_validate(r) for r in rows],
        total=len(rows),
        limit=len(rows),
        offset=0,
    )


@router.get(
    "/blobs/{sha}", response_class=Response, responses={200: {"content": {"image/png": {}}}}
)
def get_blob(sha: BlobId, token: Reader) -> Response:
    """A stored blob (observation images are PNG) by its sha256."""
    data = blob_store().get(check_sha(sha))
    media = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "application/octet-stream"
    return Response(
        data, media_type=media, headers={"Cache-Control": "private, max-age=31536000, immutable"}
    )


def _step_out(cls, step, corrections):  # type: ignore[no-untyped-def]
    out = cls.model_validate(step)
    out.display_url = f"/api/steps/{step.id}/display"
    out.corrections = [CorrectionOut.model_validate(c) for c in corrections]
    return out
