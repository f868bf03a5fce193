"""Built study reports, kept so that a study page never waits on the bootstrap twice.

In memory by study and a fingerprint of what a report is built from (the study's row and spec,
each of its runs' status and progress, its newest update row); a finished study's report is also
kept in the data folder (by database, fingerprint and this package's code), so a restarted
server, another worker, or the page after `gtr study import` (which keeps it) reads it instead
of rebuilding it. A live study's report is rebuilt when its fingerprint changes, and at least
every LIVE_TTL_S (a late correction rewrites an update's figures in place)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.study import service
from services.study.report import StudyReport, build_report
from shared.db.models import Run, Study, Update
from shared.settings import get_settings

_CACHE: OrderedDict[int, tuple[tuple[Any, ...], float, StudyReport]] = OrderedDict()
CACHE_SIZE = 8
LIVE_TTL_S = 15.0
STUDY_CODE = Path(__file__).resolve().parent


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


def _kept_file(db: Session, study_id: int, key: tuple[Any, ...]) -> Path:
    url = str(db.get_bind().engine.url)
    name = hashlib.sha256(repr((url, key, _code_version())).encode()).hexdigest()[:24]
    return get_settings().data_dir / "cache" / "study-reports" / f"{study_id}-{name}.json"


def _kept(db: Session, study_id: int, key: tuple[Any, ...]) -> StudyReport | None:
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


def report_of(db: Session, study: Study) -> StudyReport:
    """The study's report: from memory, from the data folder (a finished study), or built."""
    key, now = _fingerprint(db, study), time.monotonic()
    hit = _CACHE.get(study.id)
    live = study.status in service.ACTIVE
    if hit is not None and hit[0] == key and not (live and now - hit[1] > LIVE_TTL_S):
        _CACHE.move_to_end(study.id)
        return hit[2]
    report = None if live else _kept(db, study.id, key)
    if report is None:
        report = build_report(db, study.id)
        if not live:
            _keep(db, study.id, key, report)
    _CACHE[study.id] = (key, now, report)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return report
