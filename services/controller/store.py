"""The run driver's reads and writes of the run's record: the run row, its update rows, episode
counts, correction verdicts. Named queries, so ``RunDriver`` reads as its stages; what a rollout
writes (episodes, steps, frames) is ``recorder.py``'s. Functions take a session and never commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from services.controller.recorder import close_cut_off
from shared.db.models import Correction, Episode, EvalOutcome, Run, Step, Update, utcnow
from shared.schemas import RunConfig

if TYPE_CHECKING:
    from services.controller.evaluate import DealOutcome


def run_row(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"run {run_id} does not exist")
    return run


def run_config(session: Session, run_id: int) -> RunConfig:
    return RunConfig.model_validate(run_row(session, run_id).config)


@dataclass
class ResumePoint:
    """Where a (re)started driver picks the run up."""

    last_trained: int  # the last update trained; -1: none yet
    pending: bool  # update last_trained + 1 has its rollout stored, not trained
    updates_done: int  # updates recorded in full (probed, evaluated) by the driver


def mark_running(session: Session, run_id: int) -> ResumePoint:
    """The run is running (again), its start time kept from a first start; where it resumes."""
    run = run_row(session, run_id)
    run.status, run.error = "running", None
    run.started_at = run.started_at or utcnow()
    rows = session.scalars(select(Update).where(Update.run_id == run_id)).all()
    last = max((u.idx for u in rows if u.metrics.get("trained")), default=-1)
    pending = any(u.idx == last + 1 and u.metrics.get("rollout_sha") for u in rows)
    return ResumePoint(last, pending, run.updates_done)


def recount_env_steps(session: Session, run_id: int) -> None:
    """The run's env-step count from the steps it has recorded (after a resume dropped some)."""
    count = select(func.count()).select_from(Step).where(Step.run_id == run_id)
    run_row(session, run_id).env_steps = session.scalar(count) or 0


def last_finished_episodes(session: Session, run_id: int, n: int) -> list[Any]:
    """(success, total_return, length) of the run's last ``n`` finished episodes, oldest first."""
    rows = session.execute(
        select(Episode.success, Episode.total_return, Episode.length)
        .where(
            Episode.run_id == run_id,
            Episode.finished.is_(True),
            Episode.success.is_not(None),
        )
        .order_by(Episode.id.desc())
        .limit(n)
    ).all()
    return list(rows)[::-1]


def next_episode_seq(session: Session, run_id: int, env_index: int) -> int:
    """The sequence number the next episode of one env gets: how many it has had."""
    count = (
        select(func.count())
        .select_from(Episode)
        .where(Episode.run_id == run_id, Episode.env_index == env_index)
    )
    return int(session.scalar(count) or 0)


def episode_counts(session: Session, run_id: int) -> dict[str, float]:
    """Episodes begun and finished so far: "0 of N finished" is shown, not a missing row."""
    finished = Episode.finished.is_(True) & Episode.success.is_not(None)
    started, done = session.execute(
        select(func.count(), func.count().filter(finished)).where(Episode.run_id == run_id)
    ).one()
    return {"episodes_started": float(started), "episodes_finished": float(done)}


def add_update(session: Session, run_id: int, update_idx: int, metrics: dict[str, Any]) -> None:
    """The update's row, with its rollout's sha and metrics: the trainer's input."""
    session.add(Update(run_id=run_id, idx=update_idx, metrics=metrics))


def update_row(session: Session, run_id: int, update_idx: int) -> Update:
    row = session.scalar(select(Update).where(Update.run_id == run_id, Update.idx == update_idx))
    if row is None:
        raise LookupError(f"run {run_id} has no update {update_idx}")
    return row


def metrics_before(session: Session, run_id: int, update_idx: int) -> list[dict[str, Any]]:
    """The metrics of the run's updates before ``update_idx``."""
    query = (
        select(Update.metrics)
        .where(Update.run_id == run_id, Update.idx < update_idx)
        .order_by(Update.idx)
    )
    return list(session.scalars(query).all())


def finish_update(run: Run, row: Update, metrics: dict[str, Any], alarm: bool) -> None:
    """An update recorded in full: its metrics and alarm; the run's count, alarm, heartbeat."""
    row.metrics, row.alarm = metrics, alarm
    run.updates_done, run.alarm, run.heartbeat_at = row.idx + 1, alarm, utcnow()


def set_tracking(run: Run, status: dict[str, Any]) -> None:
    """The trackers' state on the run record (a failed tracker shows there)."""
    run.info = {**(run.info or {}), "tracking": status}


def done_correction_extras(session: Session, step_ids: list[int]) -> dict[int, Any]:
    """Step id -> the task extras of its finished correction, for the steps that have one."""
    query = select(Correction.step_id, Correction.extras).where(
        Correction.step_id.in_(step_ids), Correction.status == "done"
    )
    return dict(session.execute(query).tuples().all())


def end_step(session: Session, step_id: int, reward: float) -> float:
    """A step the corrector's verdict ends: its reward replaced; returns the reward it had."""
    step = session.get(Step, step_id)
    if step is None:
        raise LookupError(f"step {step_id} does not exist")
    old = float(step.reward)
    step.reward, step.done = reward, True
    return old


def end_run(session: Session, run_id: int, status: str, error: str | None) -> Run:
    """The run's final status; its phase cleared and its episodes still open closed as cut off."""
    run = run_row(session, run_id)
    run.status, run.finished_at = status, utcnow()
    run.phase = run.phase_step = run.phase_total = None
    close_cut_off(session, run_id)
    if error:
        run.error = error[:4000]
    return run


def record_eval_outcomes(
    session: Session, run_id: int, update_idx: int, outcomes: Sequence[DealOutcome]
) -> None:
    """The per-deal outcomes of the run's evaluation after ``update_idx``; a resumed run that
    evaluates that update again replaces them."""
    session.execute(
        delete(EvalOutcome).where(
            EvalOutcome.run_id == run_id, EvalOutcome.update_idx == update_idx
        )
    )
    session.add_all(
        EvalOutcome(
            run_id=run_id,
            update_idx=update_idx,
            deal=o.deal,
            seed=o.seed,
            success=o.success,
            episode_return=o.episode_return,
            episode_length=o.episode_length,
        )
        for o in outcomes
    )
