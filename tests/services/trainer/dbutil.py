"""Rows a trainer test needs: a run, its episode and steps, corrections, update rows."""

from __future__ import annotations

from sqlalchemy.orm import Session

from shared.db.models import Correction, Episode, Run, Step, Update
from shared.schemas import RunConfig


def make_run(session: Session, cfg: RunConfig) -> Run:
    run = Run(
        name=cfg.name,
        task=cfg.task,
        algorithm=cfg.algorithm,
        config=cfg.model_dump(),
        total_env_steps=cfg.total_env_steps,
        num_updates=cfg.train.num_updates,
    )
    session.add(run)
    session.flush()
    return run


def make_step(
    session: Session, run: Run, idx: int, action: str, image_sha: str | None, update_idx: int = 0
) -> Step:
    episode = Episode(run_id=run.id, env_index=0, seq=idx, update_idx=update_idx)
    session.add(episode)
    session.flush()
    step = Step(
        run_id=run.id,
        episode_id=episode.id,
        idx=0,
        update_idx=update_idx,
        rollout_pos=idx,
        prompt="go",
        output="{}",
        action_text=action,
        parsed_action=action,
        format_valid=True,
        action_valid=True,
        reward=0.0,
        done=False,
        image_sha=image_sha,
    )
    session.add(step)
    session.flush()
    return step


def make_correction(
    session: Session,
    step: Step,
    thought: str | None,
    status: str = "done",
    verdict: str = "incorrect",
    corrector: str = "oracle",
) -> Correction:
    corr = Correction(
        step_id=step.id,
        run_id=step.run_id,
        update_idx=step.update_idx,
        corrector=corrector,
        status=status,
        verdict=verdict,
        corrected_thought=thought,
    )
    session.add(corr)
    session.flush()
    return corr


def make_update(session: Session, run: Run, idx: int, rollout_sha: str) -> Update:
    row = Update(run_id=run.id, idx=idx, metrics={"rollout_sha": rollout_sha})
    session.add(row)
    session.flush()
    return row
