"""Queries and commands behind the REST API. Functions take a Session and never commit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

# A run's launch (its checks, the queued row) lies below the API: `gtr train` shares it.
from services.controller.launch import Invalid as Invalid
from services.controller.launch import check_corrector as check_corrector
from services.controller.launch import create_run as create_run
from shared.db.models import (
    TERMINAL_STATUSES,
    ApiToken,
    Checkpoint,
    Correction,
    CorrectorSpend,
    Episode,
    EvalOutcome,
    Run,
    Step,
    Update,
)
from shared.schemas import NO_CORRECTOR_ALGORITHMS


class NotFound(LookupError):
    pass


class Conflict(RuntimeError):
    pass


def visible_runs(token: ApiToken):  # type: ignore[no-untyped-def]
    """Runs are owned by a team; admin tokens see every team."""
    query = select(Run)
    return query if token.scope == "admin" else query.where(Run.team == token.team)


def list_runs(
    session: Session, token: ApiToken, status: str | None, limit: int, offset: int
) -> tuple[Sequence[Run], int]:
    query = visible_runs(token)
    if status:
        query = query.where(Run.status == status)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Run.id.desc()).limit(limit).offset(offset)).all()
    return rows, total


def get_run(session: Session, token: ApiToken, run_id: int) -> Run:
    run = session.scalar(visible_runs(token).where(Run.id == run_id))
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


def _visible(session: Session, token: ApiToken, run_id: int) -> bool:
    return session.scalar(visible_runs(token).where(Run.id == run_id)) is not None


def latest_metrics(session: Session, run_id: int) -> dict[str, Any]:
    """The newest value of each metric. An update row is written in two halves (rollout, then
    training and probe), so the one before fills what the newest does not have yet: the stat
    cards keep their last value during an update instead of blanking."""
    rows = session.scalars(
        select(Update).where(Update.run_id == run_id).order_by(Update.idx.desc()).limit(2)
    ).all()
    merged: dict[str, Any] = {}
    for row in reversed(rows):
        merged.update(row.metrics or {})
    return merged


def latest_eval(session: Session, run_id: int) -> tuple[float, int] | None:
    """The latest greedy evaluation's success rate and the update it followed: the figure to
    judge learning by, kept between evaluations (most updates have none)."""
    value = Update.metrics["eval/success_rate"].as_float()
    row = session.execute(
        select(value, Update.idx)
        .where(Update.run_id == run_id, value.is_not(None))
        .order_by(Update.idx.desc())
        .limit(1)
    ).first()
    return None if row is None else (float(row[0]), int(row[1]))


def sends_to_corrector(run: Run) -> bool:
    """RunConfig.uses_corrector read from the stored config (no re-validation of old runs)."""
    judge = float(((run.config or {}).get("train") or {}).get("judge_reward") or 0)
    return run.algorithm not in NO_CORRECTOR_ALGORITHMS or judge > 0


def corrector_cost(session: Session, run_id: int) -> dict[str, float]:
    """What the run's corrections cost: calls sent to a corrector's endpoint (retries included)
    and tokens billed, from the spend ledger, and the seconds the finished corrections took. A
    local corrector (the oracle, the self-teacher) calls nothing: its cost is those seconds."""
    spend = select(
        func.coalesce(func.sum(CorrectorSpend.calls), 0),
        func.coalesce(func.sum(CorrectorSpend.tokens), 0),
    ).where(CorrectorSpend.run_id == run_id)
    calls, tokens = session.execute(spend).one()
    ms = session.scalar(
        select(func.coalesce(func.sum(Correction.latency_ms), 0.0)).where(
            Correction.run_id == run_id, Correction.status == "done"
        )
    )
    return {"calls": int(calls), "tokens": int(tokens), "seconds": float(ms or 0) / 1000}


RATE_WINDOW = 5  # the ETA's rate: the mean wall time of the run's last few updates
EVAL_WINDOW = 3  # and of its last few evaluations, however far back (eval_every may be 10)


def _evaluated_updates(run_id: int) -> Any:
    """The updates of a run that ended with an evaluation (their deals' outcomes recorded)."""
    return (
        select(EvalOutcome.update_idx)
        .where(EvalOutcome.run_id == run_id, EvalOutcome.update_idx >= 0)
        .distinct()
    )


def _aware(t: datetime, like: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=like.tzinfo)


def run_timing(session: Session, run: Run) -> dict[str, Any]:
    """Elapsed seconds of work (time spent cancelled or failed before a resume left out) and an
    ETA at each stage's own measured rate, counting down within the stage: during the warm
    start, its current stage's steps per second as last reported (``eta_of`` "warm start": the
    updates' rate is not known yet); then the recent updates' rollout, training, evaluation and
    other seconds, each stage's time left being its mean less the time it has already run (an
    evaluation's at the latest rollout's generation cost: ``shared.phase.stage_seconds``).
    ``eta_over_s``: how long the stage under way has run past its measured seconds (the warm
    start past its last estimate); where it is above 0 the ETA is a floor."""
    from shared.db.models import utcnow
    from shared.phase import run_left_s, stage_over_s, stage_seconds

    out: dict[str, Any] = {"elapsed_s": None, "eta_s": None, "eta_of": None, "eta_over_s": 0.0}
    if run.started_at is None:
        return out
    now = utcnow()
    end = run.finished_at or now
    paused = float((run.info or {}).get("paused_s") or 0.0)
    out["elapsed_s"] = max(0.0, (end - _aware(run.started_at, end)).total_seconds() - paused)
    if run.finished_at is not None or run.status != "running":
        return out
    if run.phase == "warm_start":
        eta = (run.info or {}).get("eta") or {}
        try:
            at = _aware(datetime.fromisoformat(eta["at"]), now)
            if run.phase_at is None or at >= _aware(run.phase_at, now):  # this warm start's
                left = float(eta["left_s"]) - (now - at).total_seconds()
                out["eta_s"], out["eta_of"] = max(0.0, left), "warm start"
                out["eta_over_s"] = max(0.0, -left)
        except (KeyError, TypeError, ValueError):
            pass
        return out
    if run.updates_done < 1 or run.updates_done >= run.num_updates:
        return out
    rows = session.scalars(
        select(Update.metrics)
        .where(Update.run_id == run.id, Update.idx < run.updates_done)
        .order_by(Update.idx.desc())
        .limit(RATE_WINDOW)
    ).all()
    evaluated = session.scalars(
        select(Update.metrics)
        .where(Update.run_id == run.id, Update.idx < run.updates_done)
        .where(Update.idx.in_(_evaluated_updates(run.id)))
        .order_by(Update.idx.desc())
        .limit(EVAL_WINDOW)
    ).all()
    stages = stage_seconds(list(rows), list(evaluated))
    if stages is None:
        return out
    metrics = (run.config or {}).get("metrics") or {}
    in_phase = (now - _aware(run.phase_at, now)).total_seconds() if run.phase_at else 0.0
    phase = run.phase
    if phase in ("training", "evaluating") and not session.scalar(
        select(Update.id).where(Update.run_id == run.id, Update.idx == run.updates_done)
    ):  # the update under way has not rolled out: the phase is still the last one's end
        phase, in_phase = "rollout", 0.0
    where = (
        stages,
        phase,
        max(0.0, in_phase),
        run.updates_done,
        run.num_updates,
        int(metrics.get("eval_every", 1) or 1),
        int(metrics.get("eval_episodes", 0) or 0),
    )
    out["eta_s"], out["eta_over_s"] = run_left_s(*where), stage_over_s(*where)
    out["eta_of"] = "run"
    return out


def cancel_run(session: Session, token: ApiToken, run_id: int) -> Run:
    run = get_run(session, token, run_id)
    if run.status in TERMINAL_STATUSES:
        raise Conflict(f"run {run_id} is already {run.status}")
    run.cancel_requested = True
    if run.status == "queued":
        # Nobody drives it yet: cancel it here; a running run is stopped by its controller.
        from shared.db.models import utcnow

        run.status = "cancelled"
        run.finished_at = utcnow()
    return run


def resume_run(session: Session, token: ApiToken, run_id: int) -> Run:
    run = get_run(session, token, run_id)
    if run.status not in ("failed", "cancelled"):
        raise Conflict(
            f"run {run_id} is {run.status}: only a failed or cancelled run can be resumed"
        )
    recheck(session, run.config, run.team)  # an imported run's config was never launched here
    # A controller claims it and resumes after its last trained update (RunDriver._start).
    # The time it spent stopped is not the run's elapsed time (run_timing leaves it out).
    from shared.db.models import utcnow

    if run.started_at is not None and run.finished_at is not None:
        now = utcnow()
        stopped = (now - _aware(run.finished_at, now)).total_seconds()
        paused = float((run.info or {}).get("paused_s") or 0.0)
        run.info = {**(run.info or {}), "paused_s": paused + max(0.0, stopped)}
    run.status, run.finished_at, run.cancel_requested = "queued", None, False
    return run


def recheck(session: Session, config: Any, team: str) -> None:
    """A stored config about to be queued again passes the launch checks (an imported one
    never met them here); one that no longer validates is refused the same way."""
    from pydantic import ValidationError

    from services.controller.launch_checks import check_launch
    from shared.schemas import RunConfig

    try:
        parsed = RunConfig.model_validate(config)
    except ValidationError as e:
        first = e.errors()[0]
        where = tuple(str(p) for p in first["loc"]) or ("config",)
        raise Invalid(where, f"the stored config does not validate: {first['msg']}") from None
    check_launch(session, parsed, team)


def list_updates(
    session: Session, run: Run, limit: int, offset: int
) -> tuple[Sequence[Update], int]:
    base = select(Update).where(Update.run_id == run.id)
    total = session.scalar(select(func.count()).select_from(base.subquery())) or 0
    return session.scalars(base.order_by(Update.idx).limit(limit).offset(offset)).all(), total


def list_episodes(
    session: Session,
    run: Run,
    update: int | None,
    success: bool | None,
    corrected: bool | None,
    limit: int,
    offset: int,
    newest_first: bool = False,
) -> tuple[Sequence[Episode], int]:
    query = select(Episode).where(Episode.run_id == run.id)
    if update is not None:
        query = query.where(Episode.update_idx == update)
    if success is not None:
        query = query.where(Episode.success.is_(success))
    if corrected is not None:
        query = query.where(
            Episode.corrected_steps > 0 if corrected else Episode.corrected_steps == 0
        )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    order = Episode.id.desc() if newest_first else Episode.id
    rows = session.scalars(query.order_by(order).limit(limit).offset(offset)).all()
    return rows, total


def config_toml(run: Run, copy: bool = False) -> str:
    """The run's config as TOML: shown on the run page, and (``copy``) for 'clone and edit'."""
    from shared.toml import NoToml, dumps

    config = dict(run.config)
    if copy:
        config["name"] = f"{run.name} (copy)"[:200]
    try:
        return dumps(config)
    except NoToml:  # e.g. a null inside a list of env.options: JSON, which the form takes too
        return json.dumps(config, indent=2, ensure_ascii=False)


def get_episode(session: Session, token: ApiToken, episode_id: int) -> Episode:
    episode = session.get(Episode, episode_id)
    if episode is None or not _visible(session, token, episode.run_id):
        # The same answer as a missing one: another team's ids are not confirmed to exist.
        raise NotFound(f"episode {episode_id} not found")
    return episode


def corrections_for(session: Session, step_ids: list[int]) -> dict[int, list[Correction]]:
    out: dict[int, list[Correction]] = {i: [] for i in step_ids}
    if step_ids:
        for c in session.scalars(select(Correction).where(Correction.step_id.in_(step_ids))):
            out[c.step_id].append(c)
    return out


def list_steps(session: Session, episode: Episode) -> list[tuple[Step, list[Correction]]]:
    steps = session.scalars(
        select(Step).where(Step.episode_id == episode.id).order_by(Step.idx)
    ).all()
    corr = corrections_for(session, [s.id for s in steps])
    return [(s, corr[s.id]) for s in steps]


def get_step(
    session: Session, token: ApiToken, step_id: int
) -> tuple[Step, list[Correction], dict[str, int | None]]:
    step = session.get(Step, step_id)
    if step is None or not _visible(session, token, step.run_id):
        raise NotFound(f"step {step_id} not found")
    # Neighbours come from indexed lookups only, so the page stays fast with millions of steps.
    prev_step = session.scalar(
        select(Step.id).where(Step.episode_id == step.episode_id, Step.idx == step.idx - 1)
    )
    next_step = session.scalar(
        select(Step.id).where(Step.episode_id == step.episode_id, Step.idx == step.idx + 1)
    )
    prev_ep = session.scalar(
        select(Episode.id)
        .where(Episode.run_id == step.run_id, Episode.id < step.episode_id)
        .order_by(Episode.id.desc())
        .limit(1)
    )
    next_ep = session.scalar(
        select(Episode.id)
        .where(Episode.run_id == step.run_id, Episode.id > step.episode_id)
        .order_by(Episode.id)
        .limit(1)
    )
    nav = {
        "prev_step_id": prev_step,
        "next_step_id": next_step,
        "prev_episode_id": prev_ep,
        "next_episode_id": next_ep,
    }
    return step, corrections_for(session, [step.id])[step.id], nav


def list_checkpoints(session: Session, run: Run) -> Sequence[Checkpoint]:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.update_idx)
    ).all()


def list_corrections(
    session: Session, run: Run, status: str | None, limit: int, offset: int
) -> tuple[Sequence[Correction], int]:
    query = select(Correction).where(Correction.run_id == run.id)
    if status:
        query = query.where(Correction.status == status)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    return session.scalars(query.order_by(Correction.id).limit(limit).offset(offset)).all(), total
