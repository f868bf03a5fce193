"""A study's record and its scheduler: which cell runs next, the one retry, cancel and resume.

Plain functions over a Session that never commit (the command, request or task does). Both ways
of running a study use them: `gtr study run` (embedded, its own worker processes) and the full
stack, where `advance` queues runs for the controllers (`gtr controller` calls it every poll).
A study with a tuning stage runs it first (services/study/tuning.py, polled by `advance` too).
A cell is one run of the grid; its runs are attempt 1 and, if that one failed, attempt 2. A
finished run can be superseded (`gtr study rerun`): its cell trains again as the next attempt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.controller.launch import queued_run
from services.study import tuning
from services.study.schemas import Cell, StudyConfig
from shared.db.models import ApiToken, Checkpoint, Run, Study, utcnow
from shared.schemas import RunConfig

log = logging.getLogger("gtr.study")

MAX_ATTEMPTS = 2  # a failed first attempt is retried once, then shown failed
ACTIVE = ("queued", "running")
SUPERSEDED = "superseded"


class StudyNotFound(LookupError):
    """No such study, or not visible to the asking team."""


class StudyConflict(RuntimeError):
    """The request contradicts the study's state (-> 409)."""


class StudyRefused(ValueError):
    """A study file that may not replace the stored one (-> 422)."""


def visible_studies(token: ApiToken):  # type: ignore[no-untyped-def]
    """Studies are owned by a team, as runs are; admin tokens see every team."""
    query = select(Study)
    return query if token.scope == "admin" else query.where(Study.team == token.team)


def get_study(session: Session, token: ApiToken, study_id: int) -> Study:
    study = session.scalar(visible_studies(token).where(Study.id == study_id))
    if study is None:
        raise StudyNotFound(f"study {study_id} not found")
    return study


def list_studies(
    session: Session, token: ApiToken, limit: int, offset: int
) -> tuple[Sequence[Study], int]:
    from sqlalchemy import func

    query = visible_studies(token)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Study.id.desc()).limit(limit).offset(offset)).all()
    return rows, total


def config_of(study: Study) -> StudyConfig:
    return StudyConfig.model_validate(study.spec)


def create_study(session: Session, cfg: StudyConfig, team: str) -> Study:
    """A new study row, queued; its runs are created by `advance`."""
    study = Study(
        name=cfg.name,
        team=team,
        spec=cfg.model_dump(mode="json"),
        primary_metric=cfg.primary.metric,
        status="queued",
        concurrency=cfg.concurrency,
    )
    session.add(study)
    session.flush()
    return study


def find_study(session: Session, name: str, team: str) -> Study | None:
    """The newest study of this name and team (`gtr study run` resumes it)."""
    return session.scalar(
        select(Study)
        .where(Study.name == name, Study.team == team)
        .order_by(Study.id.desc())
        .limit(1)
    )


def replace_spec(session: Session, study: Study, cfg: StudyConfig) -> None:
    """Take an edited study file for an existing study. Its primary metric is frozen once a run
    exists: judging finished runs by a statistic chosen after seeing them is what studies
    prevent; a new study (a new name) is the way to ask another question."""
    old = config_of(study)
    has_runs = session.scalar(select(Run.id).where(Run.study_id == study.id).limit(1))
    if has_runs is not None and cfg.primary != old.primary:
        raise StudyRefused(
            f"study {study.id} ({study.name!r}) has runs and its primary metric is "
            f"{old.primary.label()}; it cannot become {cfg.primary.label()}. Give the study "
            "a new name to start a new one."
        )
    study.spec = cfg.model_dump(mode="json")
    study.primary_metric = cfg.primary.metric
    study.concurrency = cfg.concurrency


def study_runs(session: Session, study_id: int) -> list[Run]:
    return list(session.scalars(select(Run).where(Run.study_id == study_id).order_by(Run.id)))


def cell_of(run: Run) -> Cell:
    task, arm, variant = run.study_task or "", run.study_arm or "", run.study_variant or ""
    return Cell(task, arm, run.study_seed or 0, variant)


@dataclass
class Plan:
    """Each cell's state: the latest attempt of each cell decides it."""

    latest: dict[Cell, Run] = field(default_factory=dict)
    pending: list[Cell] = field(default_factory=list)  # no run yet
    retry: list[Cell] = field(default_factory=list)  # attempt 1 failed: attempt 2 is due
    rerun: list[tuple[Cell, int]] = field(default_factory=list)  # superseded: (cell, attempt due)
    active: list[Run] = field(default_factory=list)  # queued or running
    done: list[Run] = field(default_factory=list)  # completed
    failed: list[Run] = field(default_factory=list)  # failed on its last attempt
    cancelled: list[Run] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        queued = sum(r.status == "queued" for r in self.active)
        return {
            "cells": len(self.latest) + len(self.pending),
            "waiting": len(self.pending) + len(self.retry) + len(self.rerun),
            "queued": queued,
            "running": len(self.active) - queued,
            "done": len(self.done),
            "failed": len(self.failed),
            "cancelled": len(self.cancelled),
        }


def plan(session: Session, study: Study) -> Plan:
    cfg = config_of(study)
    latest: dict[Cell, Run] = {}
    for run in study_runs(session, study.id):
        cell = cell_of(run)
        if cell not in latest or (run.study_attempt or 1) > (latest[cell].study_attempt or 1):
            latest[cell] = run
    out = Plan()
    for cell in cfg.cells():
        if cell not in latest:
            out.pending.append(cell)
            continue
        run = out.latest[cell] = latest[cell]
        if run.status in ACTIVE:
            out.active.append(run)
        elif run.status == "completed":
            out.done.append(run)
        elif run.status == "cancelled":
            out.cancelled.append(run)
        elif run.status == SUPERSEDED:
            out.rerun.append((cell, (run.study_attempt or 1) + 1))
        elif (run.study_attempt or 1) < MAX_ATTEMPTS:
            out.retry.append(cell)
        else:
            out.failed.append(run)
    return out


def warm_group(cfg: RunConfig) -> str | None:
    """What a run's warm start depends on (as services/trainer/warmcache.py keys it, less the
    code and model files): runs with one group share one cached warm start. None: no cache."""
    from shared.warmenv import warm_env

    if cfg.init.kind != "warm_start" or not cfg.init.cache:
        return None
    recipe = cfg.init.model_dump(mode="json", exclude={"kind", "checkpoint", "cache"})
    env = warm_env(cfg.env).model_dump()
    key = [cfg.task, cfg.seed, cfg.model.model_dump(mode="json"), env, recipe]
    return json.dumps(key, sort_keys=True, default=str)


def _warming(session: Session, runs: list[Run]) -> set[str]:
    """Warm groups of active runs that have no init checkpoint yet: a sibling started now would
    build the same warm start again instead of reusing it."""
    out = set()
    for run in runs:
        group = warm_group(RunConfig.model_validate(run.config))
        if group is None:
            continue
        init = session.scalar(
            select(Checkpoint.id).where(Checkpoint.run_id == run.id, Checkpoint.update_idx == -1)
        )
        if init is None:
            out.add(group)
    return out


def launch(session: Session, study: Study, cfg: StudyConfig, cell: Cell, attempt: int) -> Run:
    """The cell's run, queued: a controller (or the embedded runner) takes it from there."""
    config = cfg.run_config(cell)
    run = queued_run(
        config,
        study.team,
        study_id=study.id,
        study_task=cell.task,
        study_arm=cell.arm,
        study_seed=cell.seed,
        study_variant=cell.variant,
        study_attempt=attempt,
    )
    session.add(run)
    session.flush()
    return run


def advance(
    session: Session, study: Study, limit: int | None = None, say: tuning.Say | None = None
) -> list[Run]:
    """Queue the next runs of the study, up to ``limit`` (default: its concurrency) active at
    once, retries first; then bring the study's status up to date. Returns the runs queued."""
    if study.status == "cancelled":
        return []
    cfg = config_of(study)
    if cfg.tuning is not None:
        # Row lock (PostgreSQL; advance_all holds it already): a request advancing the study
        # beside a controller never asks Optuna twice or queues a trial's runs twice.
        session.scalar(select(Study.id).where(Study.id == study.id).with_for_update())
    stage = tuning.advance(session, study, cfg, say)
    if stage.selected is None:  # the tuning stage first: the grid waits for every choice
        _set_tuning_status(session, study)
        return stage.queued
    if stage.selected:
        tuned = tuning.apply_selection(cfg, stage.selected)
        if tuned != cfg:  # the stored file carries the choices the grid runs with
            cfg = tuned
            study.spec = cfg.model_dump(mode="json")
    p = plan(session, study)
    slots = (limit or study.concurrency) - len(p.active)
    warming = _warming(session, p.active)
    queued: list[Run] = []
    due = [*((c, MAX_ATTEMPTS) for c in p.retry), *p.rerun, *((c, 1) for c in p.pending)]
    for cell, attempt in due:
        if slots <= 0:
            break
        group = warm_group(cfg.run_config(cell))
        if group is not None and group in warming:
            continue  # its warm start is being built by a sibling: wait for it
        queued.append(launch(session, study, cfg, cell, attempt))
        slots -= 1
        if group is not None:
            warming.add(group)
    if queued:
        p = plan(session, study)
    _set_status(study, p)
    return [*stage.queued, *queued]


def _set_tuning_status(session: Session, study: Study) -> None:
    """While tuning: running once a trial run has started, queued before."""
    started = any(r.status != "queued" for r in tuning.trial_runs(session, study.id))
    status = "running" if started else "queued"
    if status != study.status:
        study.status = status
        study.updated_at = utcnow()


def supersede(session: Session, study: Study, run_ids: Sequence[int], why: str) -> list[Run]:
    """Mark finished runs of the study superseded, so that their cells train again (the next
    `advance` queues each as its next attempt). The runs keep their data and pages; the report
    and the bundle leave them out. Raises StudyConflict naming the first run that is not a
    finished run of this study, and then changes nothing."""
    runs: list[Run] = []
    for run_id in dict.fromkeys(run_ids):
        run = session.get(Run, run_id)
        if run is None or run.study_id != study.id:
            raise StudyConflict(f"run {run_id} is not a run of study {study.id}")
        if run.status in (*ACTIVE, SUPERSEDED):
            raise StudyConflict(
                f"run {run_id} is {run.status}: only a finished run can be superseded"
            )
        later = session.scalar(
            select(Run.id).where(
                Run.study_id == study.id,
                Run.study_task == run.study_task,
                Run.study_arm == run.study_arm,
                Run.study_seed == run.study_seed,
                Run.study_variant == run.study_variant,
                Run.study_attempt > (run.study_attempt or 1),
            )
        )
        if later is not None:
            raise StudyConflict(f"run {run_id} is not its cell's latest run (run {later} is)")
        runs.append(run)
    for run in runs:
        run.status = SUPERSEDED
        run.info = {**(run.info or {}), "superseded": {"why": why, "at": utcnow().isoformat()}}
    if runs and study.status in ("done", "failed"):
        study.status = "queued"  # its cells have work again; a cancelled study stays stopped
    study.updated_at = utcnow()
    return runs


def other_starts(session: Session, run: Run) -> list[Run]:
    """The finished runs of the run's study, task and seed that started from other weights
    (their init_weights_sha256 differ): the seed's paired differences would compare unlike
    starts. Empty where the run recorded no hash."""
    sha = (run.info or {}).get("init_weights_sha256")
    if run.study_id is None or not sha:
        return []
    siblings = session.scalars(
        select(Run)
        .where(
            Run.study_id == run.study_id,
            Run.study_task == run.study_task,
            Run.study_seed == run.study_seed,
            Run.status == "completed",
            Run.id != run.id,
        )
        .order_by(Run.id)
    )
    return [r for r in siblings if (r.info or {}).get("init_weights_sha256") not in (None, sha)]


def _set_status(study: Study, p: Plan) -> None:
    if p.active or p.pending or p.retry or p.rerun:
        started = p.done or p.failed or any(r.status == "running" for r in p.active)
        status = "running" if started else "queued"
    elif p.cancelled:
        status = "cancelled"
    else:
        status = "done" if p.done else "failed"
    if status != study.status:
        study.status = status
        study.updated_at = utcnow()


def cancel_study(session: Session, study: Study) -> Study:
    """Stop the study: queued runs are cancelled here, running ones by their driver."""
    if study.status in ("done", "failed", "cancelled"):
        raise StudyConflict(f"study {study.id} is already {study.status}")
    now = utcnow()
    trials = tuning.trial_runs(session, study.id) if config_of(study).tuning else []
    for run in [*study_runs(session, study.id), *trials]:
        if run.status == "queued":
            run.status, run.finished_at, run.cancel_requested = "cancelled", now, True
        elif run.status == "running":
            run.cancel_requested = True
    study.status, study.updated_at = "cancelled", now
    return study


def resume_study(session: Session, study: Study) -> Study:
    """Continue a cancelled or interrupted study: its cancelled runs are queued again (each
    resumes after its last trained update) and the cells not started yet follow (a running
    trial's cancelled runs: by the tuning stage's next poll). A finished run is never rerun; a
    run that failed twice stays failed."""
    if study.status in ("queued", "running"):
        raise StudyConflict(f"study {study.id} is {study.status}: nothing to resume")
    p = plan(session, study)
    for run in p.cancelled:
        run.status, run.finished_at, run.cancel_requested = "queued", None, False
    study.status, study.updated_at = "queued", utcnow()
    return study


def advance_all(session: Session) -> int:
    """`advance` every study that still has work (the full stack's controllers call this each
    poll); returns the runs queued."""
    ids = session.scalars(select(Study.id).where(Study.status.in_(("queued", "running")))).all()
    count = 0
    for study_id in ids:
        # Row lock (PostgreSQL): two controllers advancing one study never queue a cell twice;
        # the unique cell key is the backstop.
        study = session.scalar(select(Study).where(Study.id == study_id).with_for_update())
        if study is None:
            continue
        try:
            count += len(advance(session, study))
        except ValidationError as e:
            # A study file this version cannot read (written by a newer one, mid-upgrade): its
            # runs wait for a controller that can; every other study goes on.
            log.warning("study %s skipped: its stored file does not validate here: %s", study.id, e)
    return count


def finished(study: Study) -> bool:
    return study.status in ("done", "failed", "cancelled")


def requeue_orphans(session: Session, study: Study, stale_s: float) -> int:
    """Embedded: runs of the study left 'running' by a process that died (heartbeat older than
    ``stale_s``) go back to the queue; their driver resumes after the last trained update."""
    from datetime import timedelta

    stale = utcnow() - timedelta(seconds=stale_s)
    result: Any = session.execute(
        update(Run)
        .where(
            (Run.study_id == study.id) | tuning.of_study(study.id),
            Run.status == "running",
            (Run.heartbeat_at.is_(None)) | (Run.heartbeat_at < stale),
        )
        .values(status="queued")
    )
    return int(result.rowcount or 0)
