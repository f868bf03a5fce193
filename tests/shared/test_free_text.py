"""Model- and corrector-written text reaches PostgreSQL even when it holds a NUL byte."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.api.service import create_run
from shared.db.models import Correction, Episode, Run, Step
from shared.schemas import RunConfig

NUL_TEXT = 'I\x00 > 5, "action": "+"}'  # sampled by the tiny model in a CI run


def test_nul_in_generated_text_is_stored_as_the_replacement_character(db: Session) -> None:
    run = create_run(db, RunConfig(task="numberline"), "nul-test")
    episode = Episode(run_id=run.id, env_index=0, seq=0, update_idx=0, meta={})
    db.add(episode)
    db.flush()
    step = Step(
        run_id=run.id,
        episode_id=episode.id,
        idx=0,
        update_idx=0,
        rollout_pos=0,
        prompt="p\x00",
        output=NUL_TEXT,
        thought="t\x00",
        action_text="+\x00",
        format_valid=False,
        action_valid=False,
        reward=0.0,
        done=False,
        value=0.0,
        logprob=0.0,
        state={},
    )
    db.add(step)
    db.flush()
    db.add(
        Correction(
            run_id=run.id,
            step_id=step.id,
            update_idx=0,
            corrector="oracle",
            status="failed",
            corrected_thought="c\x00",
            reasoning="r\x00",
            raw="\x00",
            error="e\x00",
        )
    )
    db.execute(update(Run).where(Run.id == run.id).values(error=f"failed on {NUL_TEXT}"))
    db.flush()
    db.expire_all()
    stored = db.scalar(select(Step).where(Step.id == step.id))
    assert stored is not None
    assert stored.output == NUL_TEXT.replace("\x00", "\ufffd")
    assert (stored.prompt, stored.thought, stored.action_text) == ("p\ufffd", "t\ufffd", "+\ufffd")
    corr = db.scalar(select(Correction).where(Correction.step_id == step.id))
    assert corr is not None and (corr.corrected_thought, corr.error) == ("c\ufffd", "e\ufffd")
    assert "\x00" not in (db.scalar(select(Run.error).where(Run.id == run.id)) or "\x00")
