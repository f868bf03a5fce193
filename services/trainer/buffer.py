"""The DAgger buffer: every correction of a run so far, sampled for the thought-SFT loss.

A correction joins the buffer once it is done, says "incorrect" and carries a corrected thought.
Its SFT target is the corrected output with the agent's *own* action (GTR clones the thought, not
the corrector's action); every target token is supervised except the action value, so the
closing ``"}`` and EOS are trained too (the fix tiny-numberline.md found for the lost EOS).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.db.models import Correction, Step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftExample:
    correction_id: int  # corrections.id, the buffer key
    update_idx: int  # the update whose rollout produced the step (recency)
    prompt: str  # the prompt the agent saw
    image_sha: str | None  # blob of the observation image
    target: str  # the full output text to clone
    masked_span: tuple[int, int] | None  # [start, end) characters left unsupervised (the action)


def build_output_target(corrected_thought: str, action: str) -> tuple[str, None]:
    """The thought+action cloning ablation: corrected fields + an action, every token supervised."""
    from services.env.expert import format_output

    fields = json.loads(corrected_thought)
    if not isinstance(fields, dict):
        raise ValueError("a corrected thought must be a JSON object")
    fields.pop("action", None)
    return format_output({**fields, "action": action}), None


def build_target(corrected_thought: str, agent_action: str) -> tuple[str, tuple[int, int]]:
    """Corrected fields + the agent's action → (output text, char span of the action value)."""
    from services.env.expert import format_output

    fields = json.loads(corrected_thought)
    if not isinstance(fields, dict):
        raise ValueError("a corrected thought must be a JSON object")
    fields.pop("action", None)
    text = format_output({**fields, "action": agent_action})
    value = json.dumps(agent_action)
    # The action is the last key of the canonical output, so its value is its last occurrence.
    start = text.rfind(value)
    if start < 0:
        raise ValueError("the action value is not in the formatted output")
    return text, (start, start + len(value))


def load_examples(
    session: Session,
    run_id: int,
    skip_ids: set[int] | frozenset[int] = frozenset(),
    target: str = "thought",
) -> list[SftExample]:
    """Every usable correction of the run not in skip_ids, oldest first.

    target = "thought": the agent's own action, left unsupervised (GTR); "output": the
    corrector's action (``extras["action"]``, else the agent's), supervised like the rest.
    """
    rows = session.execute(
        select(Correction, Step)
        .join(Step, Step.id == Correction.step_id)
        .where(
            Correction.run_id == run_id,
            Correction.status == "done",
            Correction.verdict == "incorrect",
            Correction.corrected_thought.is_not(None),
        )
        .order_by(Correction.id)
    ).all()
    out = []
    for corr, step in rows:
        if corr.id in skip_ids:
            continue
        action = step.action_text if step.action_text is not None else step.parsed_action
        try:
            if target == "output":
                own = (corr.extras or {}).get("action")
                text, span = build_output_target(
                    corr.corrected_thought or "", str(own) if own is not None else action or ""
                )
            else:
                text, span = build_target(corr.corrected_thought or "", action or "")
        except (ValueError, TypeError) as e:  # a malformed correction is never a training target
            log.warning("skipping correction %s: %s", corr.id, e)
            continue
        out.append(SftExample(corr.id, corr.update_idx, step.prompt, step.image_sha, text, span))
    return out


class DaggerBuffer:
    """Aggregated corrections of one run; refreshed from the database before each update."""

    def __init__(self, run_id: int, sampling: str = "uniform", target: str = "thought") -> None:
        if sampling not in ("uniform", "recency", "latest"):
            raise ValueError(
                f"dagger sampling must be uniform, recency or latest, got {sampling!r}"
            )
        self.run_id, self.sampling, self.target = run_id, sampling, target
        self.examples: list[SftExample] = []
        self._seen: set[int] = set()
        # Steps recorded in the run so far, labelled or not: the reference's draw is over all.
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self.examples)

    def refresh(self, session: Session) -> int:
        """Load the corrections finished since the last refresh; returns how many were added."""
        from sqlalchemy import func

        new = load_examples(session, self.run_id, skip_ids=self._seen, target=self.target)
        self.examples.extend(new)
        self._seen.update(e.correction_id for e in new)
        count = select(func.count()).select_from(Step).where(Step.run_id == self.run_id)
        self.num_steps = int(session.scalar(count) or 0)
        return len(new)

    def add(self, examples: list[SftExample]) -> None:
        """Add examples directly (warm-start data, tests)."""
        self.examples.extend(e for e in examples if e.correction_id not in self._seen)
        self._seen.update(e.correction_id for e in examples)

    def sample(self, n: int, rng: np.random.Generator) -> list[SftExample]:
        """n examples: uniform (the reference) or weighted toward recent updates."""
        pool = self._pool()
        if not pool or n <= 0:
            return []
        k = len(pool)
        p = None
        if self.sampling == "recency":
            # Weight ∝ 1 + (update index − oldest): a linear ramp, so old data still appears.
            upd = np.asarray([e.update_idx for e in pool], dtype=np.float64)
            w = 1.0 + upd - upd.min()
            p = w / w.sum()
        idx = rng.choice(k, size=n, replace=n > k or p is not None, p=p)
        return [pool[i] for i in idx]

    def sample_reference(self, n: int, rng: np.random.Generator) -> list[SftExample]:
        """GTR's draw: n steps out of every recorded one; only the labelled draws come back.

        A draw lands on a correction with probability (corrections / steps), then on one of
        them as ``sample`` would pick it; an uncorrected step adds no SFT example.
        """
        labelled = len(self._pool())
        total = max(self.num_steps, labelled)
        if labelled == 0 or n <= 0:
            return []
        hits = int((rng.random(n) < labelled / total).sum())
        return self.sample(hits, rng)

    def _pool(self) -> list[SftExample]:
        """The examples a draw may pick: all of them, or the newest update's under "latest"."""
        if self.sampling != "latest" or not self.examples:
            return self.examples
        newest = max(e.update_idx for e in self.examples)
        return [e for e in self.examples if e.update_idx == newest]


def judged_correct(session: Session, step_ids: np.ndarray) -> np.ndarray:
    """1.0 where a step's finished correction says "correct", else 0 (the judge reward term)."""
    ids = [int(i) for i in step_ids]
    rows = session.scalars(
        select(Correction.step_id).where(
            Correction.step_id.in_(ids),
            Correction.status == "done",
            Correction.verdict == "correct",
        )
    ).all()
    correct = set(rows)
    return np.asarray([1.0 if i in correct else 0.0 for i in ids], dtype=np.float32)
