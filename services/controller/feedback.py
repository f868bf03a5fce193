"""GTR's corrector feedback into the episode (points games, ``corrector.feedback = true``).

In the reference loop the corrector answers before the next step: a verdict "no solution is
possible" ends the episode (done, reward −1), a target formula is remembered for the rest of the
episode (the corrector sees it in its next prompts), and a formula that is no longer a prefix of
that target also ends the episode. Only meaningful with ``corrector.wait = "step"``: in the
asynchronous modes the verdict comes after the episode has moved on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRUNCATION_REWARD = -1.0  # the reference's reward for a truncated card-game step


@dataclass(frozen=True)
class Feedback:
    truncate: bool  # end the episode now, the step's reward replaced by TRUNCATION_REWARD
    target_formula: str | None  # remember this target for the rest of the episode
    reason: str = ""


def decide(extras: dict[str, Any] | None, formula_after: str | None) -> Feedback:
    """What a step's correction extras mean for its episode.

    formula_after: the formula once the step's action was applied (None: the episode ended).
    """
    extras = extras or {}
    if extras.get("possible_solution") is False:
        return Feedback(True, None, "the corrector found no solution")
    target = extras.get("target_formula")
    if not isinstance(target, str) or not target.strip():
        return Feedback(False, None)
    target = target.replace(" ", "")
    if formula_after is not None and not target.startswith(formula_after.replace(" ", "")):
        return Feedback(True, target, "the formula left the corrector's target formula")
    return Feedback(False, target)
