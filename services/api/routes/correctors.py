"""The corrector registry: `/api/correctors`. Admin tokens manage it; API keys never leave it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Depends, HTTPException, Response
from sqlalchemy.orm import Session

from services.api.auth import require_admin, require_read, require_write
from services.api.deps import get_db
from services.corrector import registry
from services.corrector.schemas import (
    CorrectorCreate,
    CorrectorOut,
    CorrectorPatch,
    CorrectorStats,
    CorrectorTest,
    CorrectorTestResult,
)
from shared.db.models import ApiToken
from shared.settings import Settings, get_settings

router = APIRouter(prefix="/api/correctors", tags=["correctors"])


@contextmanager
def _http_errors() -> Iterator[None]:
    try:
        yield
    except registry.RegistryError as e:
        raise HTTPException(e.status_code, str(e)) from e


def _outbound_allowed(url: str | None, settings: Settings) -> None:
    """Refuse at registration an address that every call (Test and runs alike) would refuse:
    loopback, private or link-local while private networks are not allowed. A host that does
    not resolve yet is left to Test, which says so."""
    from services.corrector.base import CorrectorError
    from services.corrector.egress import check_destination

    if not url:
        return
    try:
        check_destination(url, settings)
    except CorrectorError as e:
        if e.kind == "config":
            raise HTTPException(422, f"base_url: {e.reason}") from None


@router.post("", status_code=201, response_model=CorrectorOut)
def create(
    body: CorrectorCreate,
    token: ApiToken = Depends(require_admin),
    db: Session = Depends(get_db, scope="function"),
    settings: Settings = Depends(get_settings),
) -> CorrectorOut:
    """Register a corrector (admin)."""
    _outbound_allowed(body.base_url, settings)
    with _http_errors():
        return registry.to_out(registry.create_corrector(db, body, token.team, settings))


@router.get("", response_model=list[CorrectorOut])
def list_all(
    token: ApiToken = Depends(require_read), db: Session = Depends(get_db, scope="function")
) -> list[CorrectorOut]:
    """List the correctors of the token's team (admin: all)."""
    return [registry.to_out(row) for row in registry.list_correctors(db, token)]


@router.get("/{corrector_id}", response_model=CorrectorOut)
def get_one(
    corrector_id: int,
    token: ApiToken = Depends(require_read),
    db: Session = Depends(get_db, scope="function"),
) -> CorrectorOut:
    """One corrector."""
    with _http_errors():
        return registry.to_out(registry.get_corrector(db, token, corrector_id))


@router.patch("/{corrector_id}", response_model=CorrectorOut)
def update(
    corrector_id: int,
    patch: CorrectorPatch,
    token: ApiToken = Depends(require_admin),
    db: Session = Depends(get_db, scope="function"),
    settings: Settings = Depends(get_settings),
) -> CorrectorOut:
    """Change a corrector's URL, model, params or key (admin)."""
    _outbound_allowed(patch.base_url, settings)
    with _http_errors():
        row = registry.get_corrector(db, token, corrector_id)
        return registry.to_out(registry.update_corrector(db, row, patch, settings))


@router.delete("/{corrector_id}", status_code=204)
def delete(
    corrector_id: int,
    token: ApiToken = Depends(require_admin),
    db: Session = Depends(get_db, scope="function"),
) -> Response:
    """Remove a corrector (admin); its recorded corrections stay."""
    with _http_errors():
        db.delete(registry.get_corrector(db, token, corrector_id))
    return Response(status_code=204)


@router.post("/{corrector_id}/test", response_model=CorrectorTestResult)
def test(
    corrector_id: int,
    body: CorrectorTest | None = None,
    token: ApiToken = Depends(require_write),
    db: Session = Depends(get_db, scope="function"),
    settings: Settings = Depends(get_settings),
) -> CorrectorTestResult:
    """Send one sample request (a rendered state) and report verdict and latency, or the error
    and the answer's malformed reason; for an openai endpoint first probe which structured
    output it enforces, ignores or refuses (as `gtr corrector test`)."""
    body = body or CorrectorTest()
    with _http_errors():
        row = registry.get_corrector(db, token, corrector_id)
        return registry.try_corrector(row, settings, body.task, body.seed, probe=body.probe)


@router.get("/{corrector_id}/stats", response_model=CorrectorStats)
def stats(
    corrector_id: int,
    token: ApiToken = Depends(require_read),
    db: Session = Depends(get_db, scope="function"),
) -> CorrectorStats:
    """Latency mean/p95, failure and disagreement rates over the recorded corrections."""
    with _http_errors():
        row = registry.get_corrector(db, token, corrector_id)
    return registry.corrector_stats(db, row.name)
